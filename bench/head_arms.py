#!/usr/bin/env python3
"""Several EAGLE-3 heads trained on one set of the target's continuations, each a variant of `specdec train head`,
then each measured in the engine: which start and feature layers a head should have (issue 20).

Arms are `name=key:value;key:value` with HeadRun fields (start: target|random; feature_layers: 2-4-7), each trained
for --minutes on the same records (made once, cached in OUT/data), exported in bf16 to OUT/NAME/export/bf16 and
walked by bench/head_acceptance.py (EAGLE-3 alone) at the temperatures asked.

GPU:  python3 bench/head_arms.py --out /tmp/arms --minutes 3 --arms "target=start:target" \\
        "top=start:target;feature_layers:2-4-7" --record $OUT/head-arms-h100.json
CPU dry run:  python3 bench/head_arms.py --device cpu --out /tmp/arms --n-prompts 16 --max-new-tokens 16 \\
        --minutes 0.05 --prompts 2 --max-tokens 8 --arms a=start:target b=start:random --record /tmp/arms.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import head_acceptance  # noqa: E402
from bench.common import environment, write_json  # noqa: E402
from specdec import SamplingParams  # noqa: E402
from specdec.assets import resolve_model  # noqa: E402
from specdec.train.head import HeadRun, make_records, train  # noqa: E402
from specdec.train.log import TrainLog  # noqa: E402


def arm(text: str) -> tuple[str, dict]:
    """'top=start:target;feature_layers:2-4-7' -> ('top', {'start': 'target', 'feature_layers': (2, 4, 7)})."""
    name, _, spec = text.partition("=")
    fields = {}
    for item in filter(None, spec.split(";")):
        key, _, value = item.partition(":")
        fields[key] = tuple(int(v) for v in value.split("-")) if key == "feature_layers" else value
    return name, fields


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="work directory (records cached in OUT/data)")
    parser.add_argument("--record", required=True)
    parser.add_argument("--arms", nargs="+", required=True, type=arm)
    parser.add_argument("--corpus", default="/tmp/hd/corpus", help="a corpus directory (specdec.data.corpus)")
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--n-prompts", type=int, default=5000)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--minutes", type=float, default=3.0, help="training time of each arm")
    parser.add_argument("--lr", type=float, default=2e-3, help="every arm's peak learning rate (ref-head's)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts the engine walks per arm")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="1,0")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--also", nargs="*", default=["ref-head"], help="heads measured as they are, beside the arms")
    parser.add_argument("--drafter", default="ref-draft", help="a drafter measured beside them ('' for none)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    out = Path(args.out)
    target = str(resolve_model(args.target))
    base = HeadRun(target, [args.corpus], str(out / "data"), heldout=str(REPO / "bench/results/ref-target-heldout.jsonl"),
                   n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens, gen_batch_size=1024, lr=args.lr,
                   max_steps=10**6, max_minutes=args.minutes, checkpoint_every=10**6, formats=("bf16",),
                   drop_overlap=True, device=args.device)
    (out / "data").mkdir(parents=True, exist_ok=True)
    records, heldout, _, _ = make_records(base, TrainLog(out / "data" / "log.jsonl", name="data"))
    record = {"environment": environment(torch.device(args.device)), "target": args.target,
              "records": len(records), "minutes_per_arm": args.minutes, "lr": args.lr, "k": args.k, "prompts": args.prompts,
              "max_tokens": args.max_tokens, "arms": {}}
    for name, fields in args.arms:
        run = dataclasses.replace(base, out=str(out / name), **fields)
        (out / name).mkdir(parents=True, exist_ok=True)
        summary = train(run, records, heldout, TrainLog(out / name / "train_log.jsonl", name=name), progress=False)
        row = {"fields": {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()},
               "steps": summary["steps"], "tokens": summary["tokens"], "feature_layers": summary["feature_layers"],
               "heldout_greedy_teacher_forced": summary["history"][-1]["acceptance"], "engine": {}}
        row["engine"] = walked(args, target, summary["exports"]["bf16"]["dir"], "eagle3")
        record["arms"][name] = row
        print(name, row, flush=True)
        write_json(args.record, record)
    for head in args.also:
        record["arms"][head] = {"engine": walked(args, target, str(resolve_model(head)), "eagle3")}
    if args.drafter:
        record["arms"][args.drafter] = {"engine": walked(args, target, str(resolve_model(args.drafter)), "draft")}
    print({name: {t: row["engine"][t]["conditional"] for t in row["engine"]} for name, row in record["arms"].items()})
    write_json(args.record, record)
    return 0


def walked(args, target: str, model: str, kind: str) -> dict:
    """{tT: acceptance per draft position} of one head (kind eagle3) or drafter (draft) at fixed k in the engine."""
    rows = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True, seed=0)
        config = head_acceptance.speculators(model, model, args.k, names=[kind])[kind]
        rows[f"t{temperature:g}"] = head_acceptance.measure(
            target, config, head_acceptance.load_prompts(args.prompts), params, args.device)[0]
    return rows


if __name__ == "__main__":
    sys.exit(main())
