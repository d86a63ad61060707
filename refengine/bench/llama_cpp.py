"""The same requests through llama.cpp's `llama-server` and through the engine, taking turns, so the
ratio of their decode rates is measured in one run (the machines this runs on drift within minutes).

`benchmarks/llama_cpp.py` (docs/performance/index.md) builds the server from llama-cpp-python's source
distribution and converts the model folder to an F32 GGUF; both engines then get the same prompt ids (token ids, so neither
tokenizer is involved), greedy, `max_tokens` new tokens each with eos ignored, all arriving at once,
with the same thread count. Each round runs every batch size once per engine (refengine in each
kernel mode, then llama.cpp; the order reverses every round), and each ratio is taken between runs
of one round, then the median over rounds is reported.

The decode rate is what each engine's own clock says about its decode: refengine's decode-only
steps (RunStats), llama.cpp's per-request `timings` (generation time from a request's first token
to its last). A batch's rate on llama.cpp is its decode tokens over the median request's generation
time: requests whose prompts were still being processed when another began decoding make that one's
time longer, and the median leaves those out. The greedy answers are compared too, as a check that
both ran the same model (a random-weight model's close top-2 margins may still flip a few).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..errors import RefengineError
from ..model import Model
from .workloads import BenchRequest, random_requests, run_requests

STARTUP_TIMEOUT_S = 600  # loading a 2.4 GB F32 GGUF from a cold disk
REQUEST_TIMEOUT_S = 3600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@contextmanager
def llama_server(binary: str | Path, gguf: str | Path, slots: int, slot_len: int, threads: int):
    """A running `llama-server` on 127.0.0.1 with `slots` parallel slots of `slot_len` positions each;
    yields its base URL. Its log goes to a temporary file, whose end a failed start reports."""
    port = _free_port()
    with tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log") as log:
        process = subprocess.Popen(
            [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
             "--ctx-size", str(slots * slot_len), "--threads", str(threads), "--threads-batch", str(threads)],
            stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while _get(url + "/health") != 200:
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = " | ".join(log.read().strip().splitlines()[-3:])
                    raise RefengineError(f"llama_server: {binary} did not come up on {url} "
                                         f"(exit {process.poll()}): {tail}")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _complete(url: str, request: BenchRequest) -> dict:
    body = {"prompt": request.prompt_ids, "n_predict": request.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "cache_prompt": False, "return_tokens": True, "stream": False}
    post = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(post, timeout=REQUEST_TIMEOUT_S) as response:
        return json.load(response)


def llama_decode(url: str, requests: list[BenchRequest]) -> dict:
    """Send every request at once; the batch's decode tokens/s and each request's token ids."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        answers = list(pool.map(lambda r: _complete(url, r), requests))
    wall = time.perf_counter() - started
    timings = [a["timings"] for a in answers]
    # a request's generation time spans predicted_n - 1 decode steps: its first token came with its prompt
    decode_tokens = sum(t["predicted_n"] - 1 for t in timings)
    generation_s = float(np.median([t["predicted_ms"] for t in timings])) / 1e3
    return {"batch": len(requests), "wall_s": wall, "decode_tokens": decode_tokens, "generation_s_median": generation_s,
            "decode_tok_s": decode_tokens / generation_s if generation_s else float("nan"),
            "prompt_ms_max": max(t["prompt_ms"] for t in timings),
            "token_ids": {r.request_id: a.get("tokens") for r, a in zip(requests, answers)}}


def run_llama_cpp(model: Model, binary: str | Path, gguf: str | Path, batch_sizes: list[int], prompt_len: int,
                  max_tokens: int, modes: list[str], rounds: int) -> dict:
    """`rounds` rounds of every batch size through each of `modes` and llama-server, taking turns."""
    threads = os.cpu_count() or 1
    workloads = {batch: random_requests(model, batch, prompt_len, max_tokens) for batch in batch_sizes}
    runs: list[dict] = []
    with llama_server(binary, gguf, max(batch_sizes), prompt_len + max_tokens, threads) as url:
        llama_decode(url, workloads[min(batch_sizes)][:1])  # the first request pays for faulting the weights in
        order = [*modes, "llama.cpp"]
        with tqdm(total=rounds * len(batch_sizes) * len(order), desc="refengine and llama.cpp in turn",
                  unit="run") as bar:
            for round_ in range(rounds):
                for batch in batch_sizes:
                    run = {"round": round_, "batch": batch}
                    for name in order if round_ % 2 == 0 else order[::-1]:
                        if name == "llama.cpp":
                            run[name] = llama_decode(url, workloads[batch])
                        else:
                            stats = run_requests(model, workloads[batch], name, batch, label=f"{name} B={batch}")
                            run[name] = stats.to_json() | {"token_ids": stats.token_ids}
                        bar.update()
                    runs.append(run)
    return {"llama_server": str(binary), "gguf": str(gguf), "threads": threads, "rounds": rounds,
            "batch_sizes": list(batch_sizes), "modes": list(modes), "runs": [_strip(r) for r in runs],
            "ratios": _ratios(runs, modes), "same_answers": _agreement(runs, modes)}


def _ratios(runs: list[dict], modes: list[str]) -> dict:
    """Per batch size: each mode over llama.cpp and (with both modes) invariant over fast, each the
    median over rounds of the ratio within a round, with the rounds' values."""
    pairs = [(f"{mode} / llama.cpp", mode, "llama.cpp") for mode in modes]
    if {"invariant", "fast"} <= set(modes):
        pairs.append(("invariant / fast", "invariant", "fast"))
    ratios: dict[str, dict] = {}
    for batch in sorted({r["batch"] for r in runs}):
        of_batch = [r for r in runs if r["batch"] == batch]
        ratios[str(batch)] = {name: {"median": float(np.median(values)), "rounds": values}
                              for name, top, bottom in pairs
                              if (values := [r[top]["decode_tok_s"] / r[bottom]["decode_tok_s"] for r in of_batch])}
    return ratios


def _agreement(runs: list[dict], modes: list[str]) -> dict:
    """Per batch size, of the first round: how many requests got the same greedy ids from each mode as
    from llama.cpp."""
    first = {r["batch"]: r for r in runs if r["round"] == 0}
    return {str(batch): {mode: sum(ids == run["llama.cpp"]["token_ids"].get(request_id)
                                   for request_id, ids in run[mode]["token_ids"].items())
                         for mode in modes} | {"requests": batch}
            for batch, run in sorted(first.items())}


def _strip(run: dict) -> dict:
    """A run for the JSON report: rates and timings, not every request's ids."""
    return {k: {f: v for f, v in value.items() if f != "token_ids"} if isinstance(value, dict) else value
            for k, value in run.items()}


def print_llama_cpp(result: dict) -> None:
    print(f"llama.cpp {result['llama_server']} on {Path(result['gguf']).name}, {result['threads']} threads; "
          f"{result['rounds']} rounds, engines taking turns; decode tok/s, median over rounds:")
    names = [*result["modes"], "llama.cpp"]
    print(f"{'B':>3} " + " ".join(f"{name:>10}" for name in names) + "  ratios (median; rounds)")
    for batch in result["batch_sizes"]:
        rates = {name: float(np.median([r[name]["decode_tok_s"] for r in result["runs"] if r["batch"] == batch]))
                 for name in [*result["modes"], "llama.cpp"]}
        ratios = "; ".join(f"{name} {ratio['median']:.2f}x ({', '.join(f'{v:.2f}' for v in ratio['rounds'])})"
                           for name, ratio in result["ratios"][str(batch)].items())
        print(f"{batch:>3} " + " ".join(f"{rate:>10.1f}" for rate in rates.values()) + f"  {ratios}")
    print("same greedy answers as llama.cpp (first round): " + "; ".join(
        f"B={batch} " + ", ".join(f"{mode} {same[mode]}/{same['requests']}" for mode in result["modes"])
        for batch, same in result["same_answers"].items()))
