"""Tokens per round at T = 1: fixed chain 1 against auto forced to width 1."""

import sys

sys.path.insert(0, "scripts")
import argparse

import jax
import numpy as np
from drafter_bench import prompt_ids

from jax_specdec import Generator, SamplingConfig
from jax_specdec.decode import auto_costs
from jax_specdec.io.draft import load_pair
from jax_specdec.schedules import Auto

loaded = load_pair("smollm2-135m", "models/smollm2-135m-eagle")
args = argparse.Namespace(
    prompt_file=None, prompt_kind="code", chat=True, prompts=4, target_dir=loaded.target_dir
)
ids = [prompt_ids(args, loaded.tokenizer)[int(sys.argv[1])]] * 16
temp = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
kw = dict(key=jax.random.key(0), max_new_tokens=128, sampling=SamplingConfig(temperature=temp))


def tau(out):
    s = out.stats
    return (
        float(np.sum(s.accepted) + np.sum(s.rounds)) / float(np.sum(s.rounds)),
        np.asarray(s.accepted_at).sum(0)[:4],
        np.asarray(s.rejected_at).sum(0)[:4],
    )


for g in (1, 2):
    out = Generator(loaded.target, loaded.draft, schedule=g).bind(ids, **kw)()
    print("chain", g, tau(out), flush=True)
    for menu in ((0, 1, 2, 3, 4, 6, 8),):
        a = Auto(widths=menu, round_costs=(1.0,) * len(menu))
        base = Generator(loaded.target, loaded.draft, schedule=a).bind(ids, **kw)
        out = auto_costs._with_input(base, a.forcing(g))()
        print("auto", menu, "@", g, tau(out), np.asarray(out.stats.gamma_rounds), flush=True)
