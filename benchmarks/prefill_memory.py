"""What one prefill step holds on the device: MLX's peak memory above what the
engine held before it (weights, KV store), per step size, against the bare model
over the same tokens and the estimate the worker sizes its steps by
(``engine.setup.activation_bytes_per_token``).

Each step is one packed forward of ``T / 1024`` prompts of 1,024 tokens
(``--row``; one new token each), run three times (the first meets new shapes). Every arm runs in
a fresh process of its own: a code tree (``--tree NAME=TREE``: ``.``, a
directory or a git revision) and, for trees that pace their prefill forwards
(``engine/layer_pacer.py``), each ``--layers-ahead`` value.

    python3 benchmarks/prefill_memory.py --tokens 4096 16384
    python3 benchmarks/prefill_memory.py --tokens 4096 16384 --layers-ahead 1 2 4 --tree before=60170d2 --tree this=.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(arm: dict) -> list[dict]:
    """In this process (its sys.path leads to the arm's tree): the bare model's and
    the engine's peak per step size."""
    import mlx.core as mx
    import numpy as np

    from benchmarks.engine import SHAPES, random_model
    from kiviq.engine import Request, build_engine
    from kiviq.engine.setup import activation_bytes_per_token
    from tests.engine_runs import IdTokenizer

    try:
        from kiviq.engine import layer_pacer
    except ImportError:  # a tree from before the pacer
        layer_pacer = None
    if layer_pacer is not None and arm["layers_ahead"] is not None:
        layer_pacer.LayerPacer.__init__.__defaults__ = (arm["layers_ahead"],)
    model = random_model(arm["shape"], getattr(mx, arm["dtype"]), None)
    row = arm["row"]
    vocab = SHAPES[arm["shape"]]["vocab_size"]
    rng = np.random.default_rng(0)

    def peak(run) -> tuple[int, float]:
        mx.synchronize()
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        run()
        mx.synchronize()
        return mx.get_peak_memory() - held, time.perf_counter() - start

    out = []
    for tokens in arm["tokens"]:
        rows = mx.array(rng.integers(10, vocab, size=(tokens // row, row)))
        bare = max(peak(lambda: mx.eval(model.model(rows)[:, -1]))[0] for _ in range(2))
        engine = build_engine(model, IdTokenizer(), kv_bits=4, max_sequences=tokens // row, max_batch_tokens=tokens)

        def one_step(engine, tag: str) -> None:
            for i in range(tokens // row):
                engine.add(Request(f"{tag}-{i}", rng.integers(10, vocab, size=row).tolist(), 1))
            steps = 0
            while engine.has_work():
                engine.step()
                steps += 1
            if steps != 1:
                raise SystemExit(f"expected one packed step of {tokens} tokens, ran {steps}")

        steps = [peak(lambda: one_step(engine, str(i))) for i in range(3)]
        out.append(dict(tokens=tokens, bare=bare, steps=steps, estimate=activation_bytes_per_token(model) * tokens,
                        paced=layer_pacer is not None))
        engine = None  # its KV store goes before the next step size's is made
    return out


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="step sizes (multiples of --row)")
    p.add_argument("--row", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--layers-ahead", type=int, nargs="*", default=[], dest="layers_ahead",
                   help="the pacer's depth, one process each (default: the tree's own)")
    p.add_argument("--tree", action="append", dest="trees", metavar="NAME=TREE")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a JSON arm: measure it, write --child-out
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        arm = json.loads(args.child)
        sys.path.insert(0, arm["tree"])
        result = measure(arm)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return
    if args.row < 1 or any(t < args.row or t % args.row for t in args.tokens):
        raise SystemExit(f"--tokens: give multiples of --row ({args.row})")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import arm_tree, command, machine, table

    print(f"# {command()}\n# {machine()}\n")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.trees or ["this=."]:
            name, _, where = spec.partition("=")
            if not name or not where:
                raise SystemExit(f"--tree: expected NAME=TREE, got {spec}")
            tree = arm_tree(where, tmp)
            for ahead in args.layers_ahead or [None]:
                arm = dict(tree=tree, shape=args.shape, dtype=args.dtype, row=args.row, tokens=args.tokens,
                           layers_ahead=ahead)
                path = os.path.join(tmp, "arm.json")
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])]))
                subprocess.run([sys.executable, __file__, "--child", json.dumps(arm), "--child-out", path],
                               check=True, env=env, cwd=tree)
                with open(path) as f:
                    for r in json.load(f):
                        t = r["tokens"]
                        first, *warm = r["steps"]
                        depth = "unpaced" if not r["paced"] else "default" if ahead is None else ahead
                        rows.append([name, depth, t,
                                     f"{gib(r['bare'])} ({r['bare'] / t / 1024:,.0f})",
                                     f"{gib(first[0])} ({first[0] / t / 1024:,.0f})",
                                     " / ".join(f"{gib(b)} ({b / t / 1024:,.0f})" for b, _ in warm),
                                     " / ".join(f"{s * 1e3:.0f}" for _, s in warm),
                                     f"{gib(r['estimate'])} ({r['estimate'] / t / 1024:,.0f})"])
                print(table(HEADER, rows[-len(args.tokens):]), flush=True)
    print(f"\n{args.shape} {args.dtype}, KIVI 4-bit; a step is T / {args.row} prompts of {args.row} tokens\n")
    print(table(HEADER, rows))


HEADER = ["tree", "layers ahead", "step tokens", "bare model GiB (KiB / token)", "first step GiB (KiB / token)",
          "later steps GiB (KiB / token)", "later steps ms", "estimate GiB (KiB / token)"]


if __name__ == "__main__":
    main()
