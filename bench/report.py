"""Render bench/README.md from the JSON results in bench/results (called at the end of `python -m bench`)."""
from __future__ import annotations

import json
from pathlib import Path

from .common import table
from .offload import SCALE_COLS

COLS = {
    "e2e": ["K", "drafter", "budget", "max_depth", "draft_width", "adaptive", "speedup", "bspp", "plain_tok_s",
            "spec_tok_s", "draft_share", "identical", "of"],
    "batch": ["K", "n_best", "batch", "specbeam_tok_s", "ct2_int8_tok_s", "specbeam_lines_s", "ct2_int8_lines_s",
              "identical_to_batch1", "peak_mb", "kv_mb_per_request"],
    "batch_speculation": ["batch", "arm", "speedup_over_plain", "bspp", "identical"],
    "sampling": ["setup", "W", "width_threshold", "speedup", "bspp", "plain_logp_per_token", "spec_logp_per_token",
                 "mean_width"],
    "synthetic": ["acceptance", "budget", "max_depth", "tree", "speedup", "bspp", "identical", "of", "draft_share",
                  "plain_s", "spec_s"],
    "offload": ["K", "draft", "drafter", "budget", "max_depth", "speedup", "bspp", "bytes_moved_per_pass",
                "load_ms_per_pass", "wait_ms_per_pass", "compute_ms_per_pass", "identical", "of"],
    "confidence": ["draft", "K", "min_path_prob", "speedup", "bspp", "draft_passes", "nodes_per_pass", "identical"],
    "kv": ["engine", "lines_s", "seconds", "passes", "ms_per_pass", "ms_in_onnxruntime_per_pass", "onnxruntime_share"],
    "ray_scale": ["engine", "cores", "actors", "lines", "shards", "lines_s", "wall_s", "identical"],
    "export_sizes": ["shapes_of", "params_m", "hf_bf16_mb", "precision", "layout", "export_s", "peak_rss_gb",
                     "size_mb", "date"],
}
TITLES = {
    "e2e": "Shipped en->de pair: exact speculative vs plain beam search (same runtime, A/B alternated)",
    "batch": "Batch translation: continuous batching vs CTranslate2 int8 generate_batch (same weights)",
    "cost": "Target pass cost vs tree size",
    "peers": "Peers on the same weights (beam search, K=4)",
    "sampling": "Speculative beam sampling (DSBD) vs plain beam sampling on the shipped pair",
    "synthetic": "Realistic scale: random large target, synthetic drafter with controlled acceptance",
    "offload": "Target streamed from disk under a memory budget (same placement for both arms)",
    "confidence": "Tree depth that follows the draft's confidence (min_path_prob), drafting on every pass",
    "kv": "Plain beam search one request at a time: where a pass's time goes, host vs resident KV, CTranslate2",
    "ray_scale": "Scale-out on Ray: translate --engine ray with 1 and 2 actors vs the single-process tool",
    "export_sizes": "Export size per precision at real shapes (random weights)",
}
EXPORT_SIZES_NOTE = (
    "Random bf16 weights at each family's real shapes, one export per child process (`peak_rss_gb` is its own); "
    "each row comes from the run on its date (`python -m bench.export_sizes --families F --precisions P --out "
    "bench/results`). int8w (int8 weight storage, fp32 compute after onnxruntime folds the dequantization at load) "
    "is batch-invariant, so exact speculation holds, at about half of fp16's folder; `quantize_dynamic` (these "
    "rows: `int8dyn`, measured when it was called int8) keeps the embedding fp32 (a Gather is not quantized) and is "
    "not batch-invariant; today's per-row `int8` stores the same int8 matrices and fp32 embedding, so its folders "
    "are about as large. Tied embeddings are stored twice in every precision (the Gather table and the head).")


PREAMBLE = ["# Benchmarks", "",
            "Every figure below was measured by one run of the command shown, on the machine named with it. "
            "Ratios are medians over alternated runs (A B A B) inside that run; absolute times vary with load.", ""]


def render(results: Path, readme: Path, command: str) -> None:
    """Rewrite the sections made from results/*.json and keep every other section of `readme` where it stands
    (the hand-written records of runs outside `python -m bench`: a render once erased them)."""
    generated = _generated(results, command)
    old = _sections(readme.read_text()) if readme.is_file() else []
    out, done, last = list(PREAMBLE), set(), None
    for title, lines in old:
        if title is None:
            continue                                  # the old preamble: written afresh above
        if title in generated:
            out += generated[title]
            done.add(title)
            last = len(out)
        else:
            out += lines
    missing = [t for t in generated if t not in done]
    if missing:                                       # new generated sections: after the last generated one
        at = len(PREAMBLE) if last is None else last
        out[at:at] = [line for t in missing for line in generated[t]]
    readme.write_text("\n".join(out).rstrip("\n") + "\n")


def _sections(text: str) -> list[tuple[str | None, list[str]]]:
    """(title, lines) per '## ' section, the lines before the first one under None."""
    out: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in text.splitlines():
        if line.startswith("## "):
            out.append((line[3:].strip(), []))
        out[-1][1].append(line)
    return out


def _generated(results: Path, command: str) -> dict[str, list[str]]:
    """Title -> the section's lines, for each result file present, in the report's order."""
    sections: dict[str, list[str]] = {}
    for name in ("e2e", "batch", "peers", "cost", "sampling", "synthetic", "offload", "confidence", "kv", "ray_scale",
                 "export_sizes"):
        path = results / f"{name}.json"
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        m = d.get("machine", {})
        how = "`python -m bench.export_sizes`" if name == "export_sizes" else f"`{command} --scenario {name}`"
        out = sections.setdefault(TITLES[name], [])
        out += [f"## {TITLES[name]}", "",
                f"{how} — {m.get('date', '?')}, {m.get('cpu', '?')}, {m.get('cores', '?')} "
                f"cores, load at start {m.get('loadavg_at_start', '?')}, onnxruntime {m.get('onnxruntime', '?')}", ""]
        if name in COLS:
            out += [table_md(d["rows"], COLS[name]), ""]
        if name == "batch":
            out += [f"{d['prompts']} held-out lines sorted by length, up to {d['max_new_tokens']} new tokens, "
                    f"{d['threads']} threads, medians of {d['reps']} alternated runs. Summary: {d['summary']}.", ""]
            if d.get("notes", {}).get("summary"):
                out += [f"Note: {d['notes']['summary']}.", ""]
            if d.get("speculation"):
                out += ["Speculation inside a batch (K=%d, speedup over plain batching at the same batch size):"
                        % d["speculation"]["K"], "", table_md(d["speculation"]["rows"], COLS["batch_speculation"]), ""]
        elif name == "cost":
            sizes = sorted({int(q) for v in d["models"].values() for q in v["ms"]})
            rows = [{"model": k, **{str(q): v["ms"].get(str(q)) for q in sizes}} for k, v in d["models"].items()]
            out += [f"Pass time in ms over a tree of Q nodes on {d['past_len']} cached tokens.", "",
                    table_md(rows, ["model"] + [str(q) for q in sizes]), ""]
            if d.get("speculation_ceiling"):
                out += ["The most exact speculation can gain with these costs (every drafted level accepted; "
                        "`free_draft`: the draft's passes cost nothing; Python overheads left out):", "",
                        table_md(d["speculation_ceiling"], ["K", "tree", "width", "depth", "free_draft", "with_draft"]), ""]
        elif name == "peers":
            tps = d["tokens_per_second"]
            rows = [{"system": k, "tokens/s": v,
                     "specbeam plain / this": f"{tps['specbeam plain'] / v:.2f}x",
                     "specbeam speculative / this": f"{tps['specbeam speculative'] / v:.2f}x"}
                    for k, v in tps.items()]
            out += [table_md(rows, ["system", "tokens/s", "specbeam plain / this", "specbeam speculative / this"]),
                    ""]
            if d.get("notes"):
                out += [f"Notes: {d['notes']}", ""]
        if name == "synthetic" and d.get("pass_ms_by_tree_size"):
            out += [f"Target: random Llama, {d['target_params_note']}, resident; K={d['K']}, {d['prompts']} prompts x "
                    f"{d['max_new_tokens']} new tokens, {d['reps']} repetitions. Pass time by tree size (ms): "
                    f"{d['pass_ms_by_tree_size']}.", ""]
        if name == "offload" and d.get("scale"):
            sc = d["scale"]
            out += [f"At scale: {sc['model']} ({sc['model_mib']} MiB) under `max_memory` {sc['max_memory_mib']} MiB "
                    f"(placement: {sc['placement'].count('disk')} layers streamed from disk), synthetic drafter "
                    f"(the plain run's next beams with a per-level acceptance, as many decoys as beams per level, "
                    f"every node scored by a resident 1-layer draft). Pass time by tree size (ms): "
                    f"{sc['pass_ms_by_tree_size']}.", "", table_md(sc["rows"], SCALE_COLS), ""]
        if name == "kv":
            out += [f"{d['prompts']} held-out lines, K={d['K']}, up to {d['max_new_tokens']} new tokens, "
                    f"max_batch_size 1, {d['threads']} threads, medians of {d['reps']} alternated runs. Summary: "
                    f"{d['summary']}. Pass time (ms) by new (Q) and cached (N) tokens: "
                    f"{d['pass_ms_by_new_and_cached']}. onnxruntime's profile of one pass "
                    f"(Q={d['op_profile']['Q']}, N={d['op_profile']['N']}, us by op): {d['op_profile']['us_by_op']}.",
                    ""]
        if name == "export_sizes":
            out += [EXPORT_SIZES_NOTE, ""]
        if name == "ray_scale":
            out += [f"{d['rows'][0]['lines']} lines of the shipped test sample, up to {d['max_new_tokens']} new "
                    f"tokens, shards of {d['shard_lines']} lines, medians of {d['reps']} alternated runs, "
                    f"OMP_NUM_THREADS = cores in every arm. lines_s is the tool's own summary (translation only); "
                    f"wall_s includes model loading and, for Ray, starting a local instance. Overhead of the Ray "
                    f"path at equal cores (1 - ray/local): {d['overhead_at_equal_cores']}; per-actor rate "
                    f"{d['per_actor_lines_s']} lines/s, 1 -> 2 actors efficiency {d['scaling_1_to_2']}.", "",
                    f"Estimate: {d['estimate']}", ""] + ([f"Notes: {d['notes']}", ""] if d.get("notes") else [])
        if (results / f"{name}.png").exists():
            out += [f"![{name}](results/{name}.png)", ""]
    return sections


def table_md(rows, cols) -> str:
    plain = table(rows, cols).splitlines()
    head, body = plain[0], plain[2:]
    fix = lambda line: "| " + " | ".join(c.strip() for c in line.split(" | ")) + " |"  # noqa: E731
    return "\n".join([fix(head), "|" + "---|" * len(cols)] + [fix(b) for b in body])
