"""models/train.py: whole-pair packing with German-side labels, resumable epochs, the top-K alignment term,
and a resumed run that ends with exactly the weights of an uninterrupted one."""
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import plain

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("models_train", ROOT / "models" / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)
IGNORE = train.IGNORE
_ship_spec = importlib.util.spec_from_file_location("models_ship", ROOT / "models" / "ship.py")
ship = importlib.util.module_from_spec(_ship_spec)
_ship_spec.loader.exec_module(ship)


def _unit(en, de, eos=0, sep=1):
    ids = np.asarray([eos, *en, sep, *de], np.int64)
    scored = np.zeros(len(ids), bool)
    scored[0] = True
    scored[len(en) + 2:] = True
    return ids, scored


def test_pack_scores_only_the_german_side_and_closing_eos():
    units = [_unit([5, 6], [7, 8]), _unit([9], [10])]
    ids, labels = train.pack(units, [0, 1], T=12, eos=0)
    assert ids.tolist() == [[0, 5, 6, 1, 7, 8, 0, 9, 1, 10, 0, 0, 0]]
    # targets: 7, 8, the EOS closing pair 0, 10, the EOS closing pair 1; never English, SEP or padding
    assert labels.tolist() == [[IGNORE, IGNORE, IGNORE, 7, 8, 0, IGNORE, IGNORE, 10, 0, IGNORE, IGNORE]]


def test_pack_starts_a_new_row_instead_of_cutting_a_pair():
    units = [_unit([5, 6], [7, 8]), _unit([9, 9, 9], [10])]
    ids, labels = train.pack(units, [0, 1], T=8, eos=0)
    assert ids.tolist() == [[0, 5, 6, 1, 7, 8, 0, 0, 0], [0, 9, 9, 9, 1, 10, 0, 0, 0]]
    assert labels[0].tolist() == [IGNORE, IGNORE, IGNORE, 7, 8, 0, IGNORE, IGNORE]


def test_batches_resume_at_the_saved_position():
    units = [_unit([i + 2], [i + 3]) for i in range(40)]
    sources = ["a"] * 20 + ["b"] * 20

    def fresh():
        return train.Batches(units, sources, {"b": 2}, T=8, B=2, eos=0, seed=3)

    run = fresh()
    assert len(run.index) == 60                      # source b repeated twice per epoch
    seq = [run.next()[0].tolist() for _ in range(15)]    # crosses into epoch 1
    resumed = fresh()
    resumed.epoch, resumed.row = 0, 0
    for _ in range(9):
        resumed.next()
    again = fresh()
    again.epoch, again.row = resumed.epoch, resumed.row
    assert [again.next()[0].tolist() for _ in range(6)] == seq[9:]


def test_parse_mix_names_the_bad_part():
    assert train.parse_mix("libreoffice=3,gimp=2") == {"libreoffice": 3, "gimp": 2}
    with pytest.raises(SystemExit, match=r"--mix 'gimp=x': each part is NAME=INTEGER"):
        train.parse_mix("gimp=x")


def test_align_loss_is_zero_only_when_the_teacher_top_k_leads_by_the_margin():
    torch = pytest.importorskip("torch")
    teacher = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    aligned = torch.tensor([[3.0, 2.5, 1.0, 0.0]])          # top-2 {0, 1} leads the best outsider by >= 1.5
    assert train.align_loss(aligned, teacher, k=2, margin=1.0).item() == 0.0
    swapped = torch.tensor([[3.0, 0.5, 1.0, 0.0]])          # token 1 trails outsider 2 by 0.5
    # hinge per top-k token: relu(1 - (3 - 1)) = 0 and relu(1 - (0.5 - 1)) = 1.5; mean over k = 0.75
    assert train.align_loss(swapped, teacher, k=2, margin=1.0).item() == pytest.approx(0.75)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    root = tmp_path_factory.mktemp("corpus")
    words = ["file", "open", "save", "the", "button", "click", "document", "menu"]
    german = ["Datei", "öffnen", "speichern", "die", "Schaltfläche", "klicken", "Dokument", "Menü"]
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(60):
        idx = rng.integers(0, len(words), size=rng.integers(2, 6))
        rows.append((" ".join(words[i] for i in idx), " ".join(german[i] for i in idx)))
    data = root / "corpus"
    data.mkdir()
    (data / "train.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in rows[:50]), encoding="utf-8")
    (data / "valid.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in rows[50:]), encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([x for r in rows for x in r], trainers.BpeTrainer(
        vocab_size=300, special_tokens=[train.EOS, train.SEP], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_dir = root / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": train.EOS,
                                                                "prompt_format": "<|endoftext|>{source}<|de|>"}))
    return data, tok_dir


def _lm(data, tok_dir, ckpt, steps, **over):
    flags = dict(layers=1, hidden=32, heads=2, kv_heads=1, seq_len=32, batch=2, lr=1e-2, warmup=2,
                 label_smoothing=0.1, mix="", schedule="invsqrt")
    flags.update(over)
    argv = ["lm", "--data", str(data), "--tokenizer", str(tok_dir), "--ckpt", str(ckpt),
            "--tokens", str(steps * flags["seq_len"] * flags["batch"]), "--log_every", "1", "--eval_every", "2"]
    for k, v in flags.items():
        argv += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    train.main(argv)


@pytest.mark.slow                                    # three short training runs: about 15 s here
def test_resumed_run_matches_an_uninterrupted_one(tiny_corpus, tmp_path):
    torch = pytest.importorskip("torch")
    data, tok_dir = tiny_corpus
    _lm(data, tok_dir, tmp_path / "straight", 6)
    _lm(data, tok_dir, tmp_path / "resumed", 3)
    _lm(data, tok_dir, tmp_path / "resumed", 6)      # same flags, larger budget: continues at step 3
    a = torch.load(tmp_path / "straight" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "last.pt", weights_only=False)
    assert (a["step"], a["epoch"], a["row"]) == (b["step"], b["epoch"], b["row"]) == (6, a["epoch"], a["row"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    # the averaged HF folder loads and carries the run's summary
    train.main(["average", "--ckpt", str(tmp_path / "resumed"), "--last", "2", "--out", str(tmp_path / "hf")])
    log = json.loads((tmp_path / "hf" / "train_log.json").read_text())
    assert log["summary"]["steps"] == 6 and log["summary"]["averaged"] == ["step00000003", "step00000006"]


def test_a_run_saved_before_a_flag_existed_resumes(tiny_corpus, tmp_path):
    """A flag added to `lm` later (here --freeze_encoder, --init_layers) is absent from older runs' saved settings:
    they trained with its default, so resuming with the default continues the run instead of refusing it."""
    torch = pytest.importorskip("torch")
    data, tok_dir = tiny_corpus
    _lm(data, tok_dir, tmp_path / "run", 1)
    state = torch.load(tmp_path / "run" / "last.pt", weights_only=False)
    for k in ("freeze_encoder", "init_layers", "arch"):
        del state["args"][k]
    torch.save(state, tmp_path / "run" / "last.pt")
    _lm(data, tok_dir, tmp_path / "run", 2)
    assert torch.load(tmp_path / "run" / "last.pt", weights_only=False)["step"] == 2
    with pytest.raises(SystemExit, match=r"other settings \{'freeze_encoder': \(False, True\)\}"):
        _lm(data, tok_dir, tmp_path / "run", 3, freeze_encoder=True)


def test_resume_with_other_settings_is_refused(tiny_corpus, tmp_path):
    data, tok_dir = tiny_corpus
    _lm(data, tok_dir, tmp_path / "run", 1)
    with pytest.raises(SystemExit, match=r"was started with other settings \{'hidden': \(32, 48\)\}"):
        _lm(data, tok_dir, tmp_path / "run", 2, hidden=48)
    # a cosine schedule's length is part of the run: a larger budget would change every later learning rate
    _lm(data, tok_dir, tmp_path / "cos", 1, schedule="cosine")
    with pytest.raises(SystemExit, match=r"other settings \{'tokens': \('64', '128'\)\}"):
        _lm(data, tok_dir, tmp_path / "cos", 2, schedule="cosine")


def test_init_layers_cuts_a_draft_from_the_target(tiny_corpus, tmp_path):
    torch = pytest.importorskip("torch")
    import argparse
    from transformers import LlamaForCausalLM

    data, tok_dir = tiny_corpus
    _lm(data, tok_dir, tmp_path / "target", 1, layers=3)
    hf = tmp_path / "hf"
    train.main(["average", "--ckpt", str(tmp_path / "target"), "--last", "1", "--out", str(hf)])
    full = LlamaForCausalLM.from_pretrained(hf).state_dict()
    cut = train.build_model(argparse.Namespace(init=str(hf), init_layers="0,2"), 300)
    assert cut.config.num_hidden_layers == 2
    sd = cut.state_dict()
    for k, v in sd.items():        # layer 1 of the cut is the target's layer 2; embedding, norm, head copied
        src = k.replace("layers.1.", "layers.2.") if "layers.1." in k else k
        assert torch.equal(v, full[src]), k
    for bad in ("0,3", "0,0", "0,2,", "x"):
        with pytest.raises(SystemExit, match=r"--init_layers .*: distinct layer numbers .* has layers 0\.\.2"):
            train.build_model(argparse.Namespace(init=str(hf), init_layers=bad), 300)
    with pytest.raises(SystemExit, match="pass --init too"):
        train.build_model(argparse.Namespace(init=None, init_layers="0"), 300)
    # a run started from the cut trains and writes a 2-layer model folder; its cut is part of the run
    _lm(data, tok_dir, tmp_path / "draft", 2, init=str(hf), init_layers="0,2")
    with pytest.raises(SystemExit, match=r"other settings \{'init_layers': \('0,2', '1,2'\)\}"):
        _lm(data, tok_dir, tmp_path / "draft", 3, init=str(hf), init_layers="1,2")
    train.main(["average", "--ckpt", str(tmp_path / "draft"), "--last", "1", "--out", str(tmp_path / "d")])
    assert json.loads((tmp_path / "d" / "config.json").read_text())["num_hidden_layers"] == 2


@pytest.mark.slow                                    # a short training run, an export and a beam search
def test_distil_writes_the_teachers_beams_for_the_chosen_sources(tiny_corpus, tmp_path):
    pytest.importorskip("torch")
    from export import export

    data, tok_dir = tiny_corpus
    n = len((data / "train.tsv").read_text(encoding="utf-8").splitlines())
    src = tmp_path / "src"
    src.mkdir()
    for f in ("train.tsv", "valid.tsv"):
        (src / f).write_bytes((data / f).read_bytes())
    (src / "train.source").write_text("".join("help\n" if i % 3 else "mo\n" for i in range(n)))
    _lm(data, tok_dir, tmp_path / "t", 2)
    train.main(["average", "--ckpt", str(tmp_path / "t"), "--last", "1", "--out", str(tmp_path / "hf")])
    export(tmp_path / "hf", tmp_path / "onnx", precision="fp32", quiet=True)
    out = tmp_path / "kd"
    argv = ["distil", "--teacher", str(tmp_path / "onnx"), "--data", str(src), "--out", str(out), "--sources", "help",
            "--return_beams", "2", "--max_new_tokens", "6", "--chunk", "8"]
    train.main(argv)
    rows = (out / "train.tsv").read_text(encoding="utf-8").splitlines()
    eng = [l.split("\t")[0] for l in (src / "train.tsv").read_text(encoding="utf-8").splitlines()]
    help_rows = [e for i, e in enumerate(eng) if i % 3]
    assert [r.split("\t")[0] for r in rows[::2]] == help_rows and len(rows) == 2 * len(help_rows)
    assert set((out / "train.source").read_text().split()) == {"help"} and (out / "valid.tsv").exists()
    for bad in ("nope", "help,nope"):       # every name must be one the corpus has; nothing is written
        with pytest.raises(SystemExit, match=r"no pairs from \['nope'\]; .* names \['help', 'mo'\]"):
            train.main(argv[:-8] + ["--out", str(tmp_path / "kd2"), "--sources", bad])
    assert not (tmp_path / "kd2").exists()
    # --limit below --chunk stops at the limit
    train.main(argv[:-8] + ["--out", str(tmp_path / "kd3"), "--limit", "3", "--chunk", "8"])
    assert len((tmp_path / "kd3" / "train.tsv").read_text(encoding="utf-8").splitlines()) == 3


def test_pair_batches_pad_split_and_resume():
    units = [(np.array([0, 5, 6, 1, 7, 8, 9]), np.array([1, 0, 0, 0, 1, 1, 1], bool)),
             (np.array([0, 5, 1, 7]), np.array([1, 0, 0, 1], bool))]
    assert [a.tolist() for a in train.split_unit(*units[0])] == [[5, 6], [7, 8, 9]]
    b = train.PairBatches(units, ["a", "b"], {}, budget=64, eos=0, start=2, pad=99, seed=0)
    src, mask, dec, lab = b.batch(np.array([0, 1]))
    assert src.tolist() == [[5, 6, 0], [5, 0, 99]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert dec.tolist() == [[2, 7, 8, 9], [2, 7, 99, 99]]
    assert lab.tolist() == [[7, 8, 9, 0], [7, 0, train.IGNORE, train.IGNORE]]
    tight = train.PairBatches(units, ["a", "b"], {}, budget=9, eos=0, start=2, pad=99, seed=0)
    assert sorted(len(x) for x in tight._epoch_plan()) == [1, 1]      # 2 x (3 + 4) > 9: one pair each
    first = [[a.tolist() for a in tight.next()] for _ in range(5)]
    again = train.PairBatches(units, ["a", "b"], {}, budget=9, eos=0, start=2, pad=99, seed=0)
    again.epoch, again.row = 1, 1                                        # resumed after 3 batches
    assert [a.tolist() for a in again.next()] == first[3]
    with pytest.raises(SystemExit, match="no German side"):
        train.split_unit(np.array([0, 5, 6]), np.array([1, 0, 0], bool))


@pytest.mark.slow                                    # two short encoder-decoder runs and a BLEU pass: ~10 s
def test_encdec_run_resumes_averages_and_scores(tiny_corpus, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    data, tok_dir = tiny_corpus
    kw = dict(arch="m2m100", hidden=32, heads=2)
    _lm(data, tok_dir, tmp_path / "straight", 4, **kw)
    _lm(data, tok_dir, tmp_path / "resumed", 2, **kw)
    _lm(data, tok_dir, tmp_path / "resumed", 4, **kw)
    a = torch.load(tmp_path / "straight" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] == 4 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert any("val_loss" in m for m in b["log"])
    train.main(["average", "--ckpt", str(tmp_path / "resumed"), "--last", "1", "--out", str(tmp_path / "hf")])
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "m2m_100" and cfg["encoder_layers"] == cfg["decoder_layers"] == 1
    tcfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert "prompt_format" not in tcfg and tcfg["pad_token"] == train.SEP
    capsys.readouterr()
    import sacrebleu
    seen = []
    real = sacrebleu.corpus_bleu

    def spy(hyps, refs):
        seen.append((list(hyps), [list(r) for r in refs]))
        return real(hyps, refs)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sacrebleu, "corpus_bleu", spy)
        train.main(["bleu", "--model", str(tmp_path / "hf"), "--test", str(data / "valid.tsv"), "--lines", "3",
                    "--num_beams", "2", "--max_new_tokens", "8", "--threads", "1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the score is BLEU of three translations against the test file's German side (it asserted only bleu >= 0,
    # which a score against the wrong side or of no lines also met)
    [(hyps, [refs])] = seen
    want = [l.rstrip("\n").split("\t")[1] for l in open(data / "valid.tsv", encoding="utf-8")][:3]
    assert report["arch"] == "m2m_100" and report["lines"] == 3 == len(hyps) and refs == want
    assert report["bleu"] == round(real(hyps, [want]).score, 2)
    # the folder exports as an encoder-decoder and the runtime's beam search gives transformers' output
    from transformers import AutoModelForSeq2SeqLM

    from export.__main__ import main as export_main
    from specbeam_edge import Engine
    assert export_main(["-i", str(tmp_path / "hf"), "-o", str(tmp_path / "onnx"), "-p", "fp32", "-q"]) == 0
    eng = Engine(tmp_path / "onnx")
    hf = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    source = (data / "valid.tsv").read_text(encoding="utf-8").splitlines()[0].split("\t")[0]
    [ours] = eng.generate([eng.tokenizer.format_prompt(source)], num_beams=2, max_new_tokens=6)
    ids = eng.tokenizer.encode(source) + [0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), num_beams=2, max_new_tokens=6, do_sample=False)[0].tolist()
    assert len(ref) >= 3 and list(ours.hypotheses[0].tokens) == [t for t in ref[1:] if t != hf.config.pad_token_id]


@pytest.mark.slow                                    # four short encoder-decoder runs: ~10 s
def test_bf16_trains_close_to_fp32_and_resumes_exactly(tiny_corpus, tmp_path):
    """--bf16 runs the forward passes in bfloat16 (the weights then differ from an fp32 run's), reaches about
    the same validation loss, and a resumed bf16 run still ends with exactly an uninterrupted one's weights."""
    torch = pytest.importorskip("torch")
    data, tok_dir = tiny_corpus
    kw = dict(arch="m2m100", hidden=32, heads=2)
    _lm(data, tok_dir, tmp_path / "fp32", 4, **kw)
    _lm(data, tok_dir, tmp_path / "bf16", 4, bf16=True, **kw)
    _lm(data, tok_dir, tmp_path / "resumed", 2, bf16=True, **kw)
    _lm(data, tok_dir, tmp_path / "resumed", 4, bf16=True, **kw)
    a, b, c = (torch.load(tmp_path / r / "last.pt", weights_only=False) for r in ("fp32", "bf16", "resumed"))
    assert not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(b["model"][k], c["model"][k]) for k in b["model"])
    va, vb = a["log"][-1]["val_loss"], b["log"][-1]["val_loss"]
    assert abs(va - vb) < 0.02 * va, (va, vb)


def _encdec_target(data, tok_dir, root, kw):
    """A tiny encoder-decoder trained two steps and averaged into an HF folder (root/hf)."""
    _lm(data, tok_dir, root / "target", 2, **kw)
    train.main(["average", "--ckpt", str(root / "target"), "--last", "1", "--out", str(root / "hf")])
    return root / "hf"


@pytest.mark.slow                                    # a short encoder-decoder run, a cut and a KD run: ~10 s
def test_encdec_draft_is_cut_from_the_target_and_distilled(tiny_corpus, tmp_path):
    torch = pytest.importorskip("torch")
    import argparse
    from transformers import M2M100ForConditionalGeneration

    data, tok_dir = tiny_corpus
    kw = dict(arch="m2m100", hidden=32, heads=2, layers=3)
    hf = _encdec_target(data, tok_dir, tmp_path, kw)
    full = M2M100ForConditionalGeneration.from_pretrained(hf).state_dict()
    cut = train.build_model(argparse.Namespace(arch="m2m100", init=str(hf), init_layers="0,2"), 300)
    assert cut.config.decoder_layers == 2 and cut.config.encoder_layers == 3
    sd = cut.state_dict()
    assert len(sd) < len(full)
    for k, v in sd.items():        # the whole encoder, decoder layers 0 and 2 (as 0 and 1), embedding, norms
        src = k.replace("decoder.layers.1.", "decoder.layers.2.")
        assert torch.equal(v, full[src]), k
    with pytest.raises(SystemExit, match=r"--init_layers 0,3: .* has decoder layers 0\.\.2"):
        train.build_model(argparse.Namespace(arch="m2m100", init=str(hf), init_layers="0,3"), 300)
    with pytest.raises(SystemExit, match=r"holds a m2m_100 model; --arch llama needs a llama folder"):
        train.build_model(argparse.Namespace(arch="llama", init=str(hf), init_layers=""), 300)
    # the cut trains with KL + top-K alignment to the encoder-decoder teacher, and exports with one fewer layer
    _lm(data, tok_dir, tmp_path / "draft", 2, init=str(hf), init_layers="0,2", teacher=str(hf), align_topk=2, **kw)
    log = torch.load(tmp_path / "draft" / "last.pt", weights_only=False)["log"]
    assert all(m["kd"] >= 0 and m["align"] >= 0 for m in log if "loss" in m)
    train.main(["average", "--ckpt", str(tmp_path / "draft"), "--last", "1", "--out", str(tmp_path / "d")])
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (cfg["encoder_layers"], cfg["decoder_layers"]) == (3, 2)


@pytest.mark.slow                                    # a target, a frozen-encoder draft run, ship.py: ~20 s
def test_frozen_encoder_draft_uses_the_targets_encoder_at_run_time(tiny_corpus, tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import M2M100ForConditionalGeneration

    from specbeam_edge import Engine, SpeculativeConfig

    data, tok_dir = tiny_corpus
    kw = dict(arch="m2m100", hidden=32, heads=2, layers=2)
    hf = _encdec_target(data, tok_dir, tmp_path, kw)
    with pytest.raises(SystemExit, match="--freeze_encoder keeps an encoder-decoder's encoder from its --init"):
        _lm(data, tok_dir, tmp_path / "bad", 1, freeze_encoder=True, **kw)
    _lm(data, tok_dir, tmp_path / "draft", 3, init=str(hf), init_layers="1", teacher=str(hf), align_topk=2,
        freeze_encoder=True, lr=5e-2, **kw)
    train.main(["average", "--ckpt", str(tmp_path / "draft"), "--last", "1", "--out", str(tmp_path / "d")])
    full = M2M100ForConditionalGeneration.from_pretrained(hf).state_dict()
    cut = M2M100ForConditionalGeneration.from_pretrained(tmp_path / "d")
    assert cut.config.specbeam_target_cross_layers == [1]
    # a second frozen phase from that draft keeps the target's layer numbers; a phase that trains the encoder
    # drops the declaration (the draft then has an encoder of its own)
    for name, extra, want in (("again", dict(freeze_encoder=True), [1]), ("own", {}, None)):
        _lm(data, tok_dir, tmp_path / name, 1, init=str(tmp_path / "d"), teacher=str(hf), **extra, **kw)
        train.main(["average", "--ckpt", str(tmp_path / name), "--last", "1", "--out", str(tmp_path / (name + "_hf"))])
        cfg = json.loads((tmp_path / (name + "_hf") / "config.json").read_text())
        assert cfg.get("specbeam_target_cross_layers") == want, name
    moved = []
    for k, v in cut.state_dict().items():      # frozen: encoder, embedding, cross K/V; the rest trained
        src = k.replace("decoder.layers.0.", "decoder.layers.1.")
        same = torch.equal(v, full[src])
        if (".encoder." in k or "shared" in k or "lm_head" in k or "embed_tokens" in k or "encoder_attn.k_proj" in k
                or "encoder_attn.v_proj" in k):
            assert same, k
        elif "embed_positions" not in k:
            moved.append(not same)
    assert moved and all(moved)
    # models/ship.py: the target int8w, the draft int8 without an encoder, only the target's HF checkpoint
    pair_data = tmp_path / "pair_data"
    (pair_data / "corpus").mkdir(parents=True)
    shutil.copytree(hf, pair_data / "target")
    shutil.copytree(tmp_path / "d", pair_data / "draft")
    shutil.copy(data / "valid.tsv", pair_data / "corpus" / "test.tsv")
    out = tmp_path / "shipped"
    assert ship.main(["--kind", "ende", "--data", str(pair_data), "--out", str(out)]) == 0
    assert sorted(p.name for p in (out / "hf").iterdir()) == ["target"] and not (out / "variants").exists()
    assert (pair_data / "hf" / "draft" / "config.json").is_file() and not (out / "draft" / "encoder.onnx").exists()
    cfg = json.loads((out / "target" / "specbeam_config.json").read_text())
    assert cfg["precision"] == "int8w" and cfg["batch_invariant"]
    assert (out / "test_sample.en").read_text().splitlines()[0] == (data / "valid.tsv").read_text().split("\t")[0]
    eng = Engine(out / "target", draft=out / "draft")
    assert eng.draft_cross == [1] and eng.draft_encoder is None
    src = eng.tokenizer.format_prompt("open the file")
    [ref] = plain(eng, src, num_beams=2, max_new_tokens=6)
    [fast] = eng.generate(src, num_beams=2, max_new_tokens=6, speculative=SpeculativeConfig(adaptive=False, budget=8, max_depth=3))
    assert ref.hypotheses[0].tokens == fast.hypotheses[0].tokens
