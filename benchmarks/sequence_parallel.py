"""The cost of sequence parallelism on CPU: step time with each sequence split over the 8
devices (Ulysses all-to-alls) vs each device holding whole sequences, at a length both run.

    python benchmarks/sequence_parallel.py                      # ~3 minutes on 2 CPU cores
    python benchmarks/sequence_parallel.py --seq_lens 4096

configs/tiny.py's Llama with 8 query heads (2 KV heads, repeated 4x) at ZeRO stage 3 on
8 fake CPU devices, 8 sequences a step, its own embedded data; both steps built as
train.py builds them (`sft_throughput.setup`) and run interleaved in one process, so
the machine's noise falls on both alike. The ratio (sequence-parallel / plain seconds
per step) is taken per round; the median is reported. Writes
benchmarks/results/sequence_parallel.json. On CPU the all-to-alls are memory copies:
this is the overhead of the extra program (trades, repeated KV heads), not of a link.
"""

import argparse
import json
import os
import statistics

from zerojax.runtime.devices import fake_cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "sequence_parallel.json")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq_lens", default="512,2048", help="lengths, comma-separated")
  parser.add_argument("--rounds", type=int, default=4)
  parser.add_argument("--steps", type=int, default=2, help="steps per variant per round")
  args = parser.parse_args()
  fake_cpu_devices(8)
  from sft_throughput import interleaved, setup

  results = []
  for seq_len in map(int, args.seq_lens.split(",")):
    common = ("zero.stage=3", "model.n_heads=8", f"train.seq_len={seq_len}",
              "train.global_batch_size=8", "model.attention_block=256",
              "model.loss_chunk=256")
    runs = {sp: setup("tiny", (*common, f"mesh.sequence_parallel={sp}"), num_devices=8)
            for sp in (True, False)}
    times = interleaved(runs, args.rounds, args.steps)
    ratios = [a / b for a, b in zip(times[True], times[False])]
    results.append(dict(seq_len=seq_len, ratio_median=statistics.median(ratios),
                        ratios=ratios, seconds_per_step={"sequence_parallel": times[True],
                                                         "plain": times[False]}))
    print(f"seq_len {seq_len}: sequence-parallel / plain step time = "
          f"{results[-1]['ratio_median']:.2f} (median of {args.rounds} rounds, "
          f"{min(ratios):.2f}-{max(ratios):.2f})", flush=True)
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  with open(OUT, "w", encoding="utf-8") as f:
    json.dump(dict(rounds=args.rounds, steps=args.steps, cpu_cores=os.cpu_count(),
                   load_avg=os.getloadavg(), results=results), f, indent=1)
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
