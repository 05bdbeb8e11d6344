#!/usr/bin/env python3
"""Reference data for a model from llama.cpp itself (the installed `llama-cpp-python` package), in the formats of
`../shared/reference/` (see its README), so that our tokenizer, forward pass and perplexity can be tested against
an independent engine on a model that folder does not cover.

    python3 scripts/llama_reference.py models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf reference/qwen-coder

writes into the output folder:
- `tokenize.jsonl`: per string of `../shared/reference/tokenize-inputs.json`: `ids_add_special_parse_special`,
  `ids_plain`, `pieces_hex` (as the shared references);
- `greedy_raw.jsonl`: the 8 `raw` prompts of `generate-prompts.json`, 32 greedy tokens each;
- `greedy_chat.jsonl`: the chat prompts below rendered with the model's own chat template (jinja2, as llama.cpp's
  Python binding renders it), 48 greedy tokens each (stopping at end-of-generation);
  both with `prompt`, `prompt_ids`, `greedy_ids` (without the end-of-generation token, which is `stop_id` when
  the model chose one, else null), `greedy_text_hex`, `greedy_text`, `top10_per_step` (one more step than
  `greedy_ids` when it stopped: the step that chose `stop_id`);
- `perplexity.json`: perplexity over `perplexity-text.txt` computed as `llama-perplexity -c 256` does (chunks of
  256 tokens, BOS in the first position when the model adds one, the second half of each chunk scored), in total
  and after the first 8 chunks (the smaller set CI checks).

Settings: CPU, 2 threads, n_ctx 1024 (perplexity: 256), n_batch 256, flash attention on (as the shared references
were made). The package's version and build are recorded in `meta.json`.
"""
import argparse
import json
import math
import os
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama

CHAT = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What does `git rebase -i HEAD~3` do?",
    "Fix the bug: def mean(xs): return sum(xs) / len(xs) + 1",
    "What is the capital of France?",
]


def top10(logits):
    order = sorted(range(len(logits)), key=lambda i: -logits[i])[:10]
    return [[i, round(float(logits[i]), 5)] for i in order]


def greedy(llm, prompt_ids, n, stop_ids):
    """Greedy steps with the top-10 logits before each."""
    llm.reset()
    llm.eval(prompt_ids)
    out, tops = [], []
    for _ in range(n):
        logits = llm.scores[llm.n_tokens - 1].tolist()
        tops.append(top10(logits))
        tok = tops[-1][0][0]
        out.append(tok)
        if tok in stop_ids:
            break
        llm.eval([tok])
    return out, tops


def record(llm, prompt, n, stop_ids):
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    gen, tops = greedy(llm, ids, n, stop_ids)
    stop = gen.pop() if gen and gen[-1] in stop_ids else None
    text = b"".join(llm.detokenize([t], special=False) for t in gen)
    return {
        "prompt": prompt,
        "prompt_ids": ids,
        "greedy_ids": gen,
        "stop_id": stop,
        "greedy_text_hex": text.hex(),
        "top10_per_step": tops,
        "greedy_text": text.decode("utf-8", errors="replace"),
    }


def render_chat(llm, user):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = llm.metadata
    template = meta["tokenizer.chat_template"]
    eos = llm._model.token_get_text(llm.token_eos())
    bos = llm._model.token_get_text(llm.token_bos()) if llm.token_bos() >= 0 else ""
    fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos, add_generation_prompt=True)
    return fmt(messages=[{"role": "user", "content": user}]).prompt


def perplexity(model, text, ctx, threads):
    llm = Llama(model_path=model, n_ctx=ctx, n_batch=ctx, n_threads=threads, logits_all=True, flash_attn=True,
                verbose=False)
    add_bos = llm._model.add_bos_token()
    toks = llm.tokenize(text.encode(), add_bos=add_bos, special=False)
    chunks = len(toks) // ctx
    first = ctx // 2
    nll, count, after = 0.0, 0, {}
    for c in range(chunks):
        chunk = toks[c * ctx:(c + 1) * ctx]
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        for j in range(first, ctx - 1):
            row = llm.scores[j].astype(np.float64)
            m = row.max()
            nll += m + math.log(np.exp(row - m).sum()) - row[chunk[j + 1]]
            count += 1
        after[c + 1] = math.exp(nll / count)
        print(f"[{c + 1}/{chunks}] {after[c + 1]:.4f}", file=sys.stderr)
    return {"ctx": ctx, "chunks": chunks, "tokens_scored": count, "ppl": round(after[chunks], 4),
            "ppl_after_8_chunks": round(after[min(8, chunks)], 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "../../shared/reference"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-perplexity", action="store_true", help="keep the folder's perplexity.json as it is")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    llm = Llama(model_path=a.model, n_ctx=1024, n_batch=256, n_threads=a.threads, logits_all=True, flash_attn=True,
                verbose=False)
    stop_ids = {llm.token_eos()}
    for name in ("<|im_end|>", "<|endoftext|>"):
        ids = llm.tokenize(name.encode(), add_bos=False, special=True)
        if len(ids) == 1:
            stop_ids.add(ids[0])

    inputs = json.load(open(os.path.join(a.shared, "tokenize-inputs.json")))
    with open(os.path.join(a.out, "tokenize.jsonl"), "w") as f:
        for text in inputs:
            special = llm.tokenize(text.encode(), add_bos=True, special=True) if text else []
            plain = llm.tokenize(text.encode(), add_bos=False, special=False) if text else []
            pieces = [llm.detokenize([t], special=True).hex() for t in special]
            f.write(json.dumps({"text": text, "ids_add_special_parse_special": special, "ids_plain": plain,
                                "pieces_hex": pieces}, ensure_ascii=False) + "\n")

    prompts = json.load(open(os.path.join(a.shared, "generate-prompts.json")))
    with open(os.path.join(a.out, "greedy_raw.jsonl"), "w") as f:
        for p in prompts["raw"]:
            f.write(json.dumps(record(llm, p, 32, stop_ids), ensure_ascii=False) + "\n")
    with open(os.path.join(a.out, "greedy_chat.jsonl"), "w") as f:
        for user in CHAT:
            f.write(json.dumps(record(llm, render_chat(llm, user), 48, stop_ids), ensure_ascii=False) + "\n")
    del llm

    meta = {"llama_cpp_python": llama_cpp.__version__, "model": os.path.basename(a.model), "threads": a.threads,
            "n_ctx": 1024, "flash_attn": True, "chat_prompts": CHAT}
    ppl_file = os.path.join(a.out, "perplexity.json")
    if a.skip_perplexity and os.path.exists(ppl_file):
        meta["perplexity"] = json.load(open(ppl_file))
    if not a.skip_perplexity:
        text = open(os.path.join(a.shared, "perplexity-text.txt")).read()
        meta["perplexity"] = perplexity(a.model, text, 256, a.threads)
        json.dump(meta["perplexity"], open(ppl_file, "w"), indent=1)
    json.dump(meta, open(os.path.join(a.out, "meta.json"), "w"), indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
