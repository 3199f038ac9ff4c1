"""Weight-init timing of the Llama-style example model: eager torch vs @compile_rng.init.

One process, all threads: eager ``init_weights`` (torch's own generator) against the
same function decorated with ``@compile_rng.init`` in tracker and invariant mode (warm:
the decorated function's first call, which compiles or falls back, is timed separately),
plus a variant without ``trunc_normal_`` (``normal_`` instead) that compiles as one
graph. Prints seconds and ns/parameter with the ratio to eager, and the one-graph
init's compile time in fresh processes (cold and warm Inductor cache) with the pass's
share; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import compile_rng  # noqa: E402
from compile_rng.launch import progress  # noqa: E402
from llama_init import BENCH_MODEL_ARGS, Transformer, add_model_args, build, init_weights  # noqa: E402


def init_normal(model: Transformer) -> None:
    """The same init with normal_ in place of trunc_normal_: one compilable graph."""
    nn.init.normal_(model.tok_embeddings.weight)
    for layer in model.layers.values():
        for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.attention.wo,
                    layer.feed_forward.w1, layer.feed_forward.w2, layer.feed_forward.w3):
            nn.init.normal_(lin.weight, std=0.02)
    nn.init.normal_(model.output.weight, std=0.02)


def timed(fn, model, repeat: int) -> tuple[float, float]:
    start = time.perf_counter()
    fn(model)
    first = time.perf_counter() - start
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(model)
        samples.append(time.perf_counter() - start)
    return first, statistics.median(samples)


def first_compile(args: argparse.Namespace) -> dict:
    """This process's first call of the one-graph init: total, backend, pass seconds
    (``--first-compile stock``: stock ``torch.compile``, compile_rng uninstalled)."""
    import torch._dynamo  # noqa: F401  (imported before timing in both)

    model = build(meta=False, args=args)
    if args.first_compile == "stock":
        compile_rng.uninstall()
        init = torch.compile(init_normal)
    else:
        init = compile_rng.init(init_normal, compile=True)
    start = time.perf_counter()
    with torch.no_grad():
        init(model)
    total = time.perf_counter() - start
    from torch._dynamo.utils import counters

    hits = {"fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"]}
    if args.first_compile == "stock":
        return {"first_call_s": total, **hits}
    (plan,) = init.backend.plans
    return {"first_call_s": total, "backend_s": plan.compile_seconds, "pass_s": plan.pass_seconds, **hits}


def compile_times(args: argparse.Namespace) -> dict:
    """``first_compile`` of compile_rng and of stock Inductor, each in two fresh processes
    sharing a new Inductor cache folder: cold (empty caches), then warm (the caches the
    first filled)."""
    import subprocess
    import tempfile

    out: dict = {}
    for who in ("compile_rng", "stock"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            argv = [sys.executable, __file__, "--first-compile", who,
                    *(f"--{k}={getattr(args, k)}" for k in BENCH_MODEL_ARGS)]
            for run in ("cold", "warm"):
                progress(f"{who}: first compile in a fresh process, {run} caches")
                result = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
                out[f"{who} {run}"] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser, BENCH_MODEL_ARGS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default="bench-init.json")
    parser.add_argument("--first-compile", choices=["compile_rng", "stock"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_compile:
        print(json.dumps(first_compile(args)))
        return
    warnings.filterwarnings("ignore", message=".*does not compile as one graph.*")
    model = build(meta=False, args=args)
    params = sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    cases = {
        "eager torch (trunc_normal_)": lambda m: init_weights(m),
        "compile_rng.init tracker": compile_rng.init(init_weights),
        "compile_rng.init invariant": compile_rng.init(init_weights, layout="invariant"),
        "eager torch (normal_)": lambda m: init_normal(m),
        "compile_rng.init tracker (normal_)": compile_rng.init(init_normal, compile=True),
    }
    rows = {}
    with torch.no_grad():
        for name, fn in cases.items():
            progress(f"{name}: first call, then {args.repeat} timed calls")
            first, warm = timed(fn, model, args.repeat)
            compiled = getattr(fn, "compiled", lambda: None)()
            rows[name] = {"first_s": first, "warm_s": warm, "ns_per_param": warm / params * 1e9, "one_graph": compiled}
    print(f"\nLlama-style model, {params / 1e6:.0f}M parameters, {torch.get_num_threads()} threads")
    print(f"{'case':<36} {'first call':>11} {'warm':>9} {'ns/param':>9} {'vs eager':>9}")
    for name, r in rows.items():
        base = rows["eager torch (normal_)" if name.endswith("(normal_)") else "eager torch (trunc_normal_)"]["warm_s"]
        how = "" if r["one_graph"] is None else ("  (one graph)" if r["one_graph"] else "  (eager on the stream)")
        print(f"{name:<36} {r['first_s']:>10.2f}s {r['warm_s']:>8.2f}s {r['ns_per_param']:>9.2f} "
              f"{base / r['warm_s']:>8.2f}x{how}")
    compiles = compile_times(args)
    print("\nOne-graph init (normal_) in a fresh process: first call = Dynamo + backend (pass + Inductor) + run")
    for run in ("cold", "warm"):
        c, stock = compiles[f"compile_rng {run}"], compiles[f"stock {run}"]
        print(f"  {run} caches: compile_rng first call {c['first_call_s']:.2f}s (backend {c['backend_s']:.2f}s, "
              f"pass {c['pass_s']:.3f}s = {c['pass_s'] / c['first_call_s']:.1%}), stock Inductor "
              f"{stock['first_call_s']:.2f}s: {c['first_call_s'] / stock['first_call_s']:.2f}x stock "
              f"(cache hits FX/AOT: compile_rng {c['fx_graph_cache_hits']}/{c['aot_cache_hits']}, "
              f"stock {stock['fx_graph_cache_hits']}/{stock['aot_cache_hits']})")
    with open(args.json, "w") as f:
        json.dump({"params": params, "rows": rows, "compile": compiles}, f, indent=1)


if __name__ == "__main__":
    main()
