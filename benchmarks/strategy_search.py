"""The best global tuple against the best per-layer strategy, predicted and measured.

    python benchmarks/strategy_search.py --ranks 2 [--model wide|gpt|resnet] [--quick]

Plans a model with `hyparflow plan --search layers`: `wide` (default), the wide-layer
MLP (three Dense 256 -> 256 and one Dense 256 -> 16384, Adam, batch 64); `gpt`,
`examples/gpt_text.py`'s GPT (2 blocks, width 64, context 64, tied embeddings); `resnet`,
`examples/digits_resnet.py`'s ResNet (8x8 digits). It writes both strategies, runs each
for real under mpiexec (`hf.fit`, random data, `measure.strategy_steps`) in
alternating rounds, keeping each one's median. Prints the predictions (both priced by
the layer profiles, as the command compares them), the measurements and the
per-layer search's own time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODEL = '''import keras


def build_model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((256,))
    x = inp
    for k in range(3):
        x = keras.layers.Dense(256, activation="relu", name=f"narrow{k}")(x)
    model = keras.Model(inp, keras.layers.Dense(16384, name="wide")(x))
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
'''

EXAMPLE = '''import sys

sys.path.insert(0, {examples!r})
import keras
import {module}


def compiled(model):  # as examples/digits_resnet.py compiles it
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss="sparse_categorical_crossentropy")
    return model


def build_model():
    keras.utils.set_random_seed(0)
    return {call}
'''
CALLS = {"gpt": ("gpt_text", "gpt_text.compile_model(gpt_text.build_model())"),
         "resnet": ("digits_resnet", "compiled(digits_resnet.build_model())")}


def source_of(name):
    """The model file `hyparflow plan` reads, for `--model`."""
    if name == "wide":
        return MODEL
    module, call = CALLS[name]
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "examples")
    return EXAMPLE.format(examples=examples, module=module, call=call)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", choices=["wide", "gpt", "resnet"], default="wide")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    source = os.path.join(tmp, f"{args.model}.py")
    with open(source, "w") as f:
        f.write(source_of(args.model))
    plans = os.path.join(tmp, "plans.json")
    cmd = [sys.executable, "-m", "hyparflow_command", "plan", source, "--batch-size",
           str(args.batch_size), "--ranks", str(args.ranks), "--microbatches", "1", "2", "4",
           "--search", "layers", "--json", plans] + (["--quick"] if args.quick else [])
    print(" ".join(cmd[1:]), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    print("\n".join(l for l in out.stdout.splitlines() if "per-layer" in l or "best " in l))
    saved = json.load(open(plans))
    from hyparflow import graph as G, plan as P
    from hyparflow.planning import command, measure, profile
    from hyparflow.planning.planner import as_layout

    graph = G.from_model(profile.load_model(source))
    files = {}
    for name, key in (("global", "global_by_profiles"), ("per layer", "per_layer")):
        layout = as_layout(saved[key])
        files[name] = os.path.join(tmp, name.replace(" ", "_") + ".json")
        P.write(files[name], graph, layout, splits=command.split_kinds(graph, layout))
    runs = {name: [] for name in files}
    for _ in range(args.rounds):
        for name, path in files.items():
            runs[name].append(measure.strategy_steps(args.ranks, source, "build_model", path,
                                                     args.batch_size, args.steps))
    print(f"\n{'':<10} {'S':>2} {'T':>2} {'R':>2} {'M':>2}  {'split layers':<34} "
          f"{'predicted s':>11} {'measured s':>10}")
    for name, key in (("global", "global_by_profiles"), ("per layer", "per_layer")):
        p = saved[key]
        print(f"{name:<10} {p['stages']:>2} {p['tensor']:>2} {p['replicas']:>2} "
              f"{p['microbatches']:>2}  {', '.join(p['tensor_layers']) or '-':<34} "
              f"{p['step_s']:>11.4f} {statistics.median(runs[name]):>10.4f}")
    print(f"per-layer search: {saved['search']['seconds']:.2f} s, "
          f"{saved['search']['predicted']} strategies over {saved['search']['shapes']} shapes")


if __name__ == "__main__":
    main()
