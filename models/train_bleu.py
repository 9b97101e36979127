"""The `bleu` command: BLEU / chrF of a trained Hugging Face folder (decoder-only or encoder-decoder) on held-out
pairs, decoded with PyTorch's generate, so the architectures compare before any export.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from models.train_data import EOS, SEP


def bleu(args) -> None:
    """BLEU / chrF of a trained Hugging Face folder (either architecture) on held-out pairs, with PyTorch's
    generate (the same decoding for both, so architectures compare before any export)."""
    import sacrebleu
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.set_num_threads(args.threads)
    folder = Path(args.model)
    cfg = AutoConfig.from_pretrained(folder)
    model = (AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM).from_pretrained(folder).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos, sep, n_tok = tok.token_to_id(EOS), tok.token_to_id(SEP), tok.get_vocab_size()
    pairs = [l.rstrip("\n").split("\t") for l in open(args.test, encoding="utf-8")][:args.lines]
    hyps, t0 = [], time.time()
    with torch.no_grad():
        for en, _ in pairs:
            ids = tok.encode(en, add_special_tokens=False).ids
            kw = dict(num_beams=args.num_beams, do_sample=False, max_new_tokens=args.max_new_tokens,
                      eos_token_id=eos, pad_token_id=cfg.pad_token_id)   # the rest from generation_config.json
            if cfg.is_encoder_decoder:
                out = model.generate(input_ids=torch.tensor([[*ids, eos]]),
                                     decoder_start_token_id=cfg.decoder_start_token_id, **kw)[0, 1:]
            else:
                prompt = [eos, *ids, sep]
                out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     **kw)[0, len(prompt):]
            hyps.append(tok.decode([t for t in out.tolist() if t != eos and t < n_tok]))
    refs = [p[1] for p in pairs]
    report = {"model": folder.name, "arch": cfg.model_type, "lines": len(pairs), "num_beams": args.num_beams,
              "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
              "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(report))
