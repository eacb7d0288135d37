"""Probe: cost-model variants beside constant γ and autoregressive decoding on SmolLM2-135M
with its feature head, all timed interleaved (medians of `--repeats`), with the round
costs and acceptance a sweep calibrated (its sweep.json), so every variant plans from
the same inputs. A variant `eXwY` is `CostModel(..., explore=X, prior_weight=Y)`.

  python scripts/experiments/cost_model_explore/cost_model_probe.py \
      --sweep scripts/experiments/sweep_smollm2_head/head2m_t0/sweep.json --batch 4 \
      --variants e0w4,e1w4,e0w16,e1w16
"""

import argparse
import json
import re

import jax
import numpy as np

from jax_specdec import Generator, SamplingConfig
from jax_specdec.cli.common import read_prompts
from jax_specdec.io import zoo
from jax_specdec.io.draft import load_pair
from jax_specdec.schedules import Constant, CostModel
from jax_specdec.sweep.run import _groups, _run_interleaved

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--sweep", required=True, help="a sweep.json whose calibration to plan with")
p.add_argument("--batch", type=int, default=4)
p.add_argument("--temperature", type=float, default=0.0)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--variants", default="e0w4,e1w4,e0w16")
p.add_argument("--head", default="models/smollm2-135m-eagle")
a = p.parse_args()
zoo.enable_compilation_cache(True)
target, draft, tok = load_pair("smollm2-135m", a.head)[:3]
PROMPTS = "scripts/experiments/sweep_smollm2_head/prompts.txt"
prompts = [tok.encode(x).ids for x in read_prompts(PROMPTS)]
calibrated = next(c for c in json.load(open(a.sweep))["costs"] if c["batch"] == a.batch)
t = f"{a.temperature:g}"
costs = tuple(ms / 1e3 for ms in calibrated[f"round_ms_t{t}"])
prior = calibrated[f"prior_alpha_t{t}"]  # one number, or one per draft position
sampling = SamplingConfig(a.temperature)
names = ["ar", "g1", "g2"]  # autoregressive, constant γ 1 and 2
generators = [Generator(target, sampling=sampling)]
generators += [Generator(target, draft, schedule=Constant(g), sampling=sampling) for g in (1, 2)]
for variant in a.variants.split(","):
    if not re.fullmatch(r"e[0-9.]+w[0-9.]+", variant):
        p.error(f"--variants: {variant!r} is not eXwY (explore X, prior weight Y)")
    explore, weight = (float(x) for x in variant[1:].split("w"))
    model = CostModel(0.0, costs, prior, prior_weight=weight, explore=explore)
    names.append(variant)
    generators.append(Generator(target, draft, schedule=model, sampling=sampling))
groups = _groups(prompts, a.batch, 4)
ar, *runs = _run_interleaved(generators, groups, jax.random.key(0), 64, a.repeats)
for name, run in zip(names, [ar, *runs], strict=True):
    rounds = None if run is ar else np.asarray(run.stats.gamma_rounds).tolist()
    row = {"batch": a.batch, "T": a.temperature, "name": name}
    row |= {"speedup": round(ar.seconds / run.seconds, 3), "gamma_rounds": rounds}
    print(json.dumps(row), flush=True)
