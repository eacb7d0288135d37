"""EleutherAI's lm-evaluation-harness driving our models: the model `jax_specdec`.

    python -m jax_specdec.eval run --model jax_specdec \\
        --model_args target=smollm2-135m,draft=ngram,num_draft_tokens=4 \\
        --tasks TASK [--include_path DIR] [lm-eval's other flags]

`python -m jax_specdec.eval` is lm-eval's own command line with this model registered
(lm-eval finds models only among the modules it imports; it has no plugin entry
points). In Python, importing this module registers it for `lm_eval.simple_evaluate`.

- `loglikelihood`: `decode.score` (one target pass over context + continuation, the raw
  model distribution), in batches of `batch_size`; contexts are cut from the left to
  fit the model's context.
- `loglikelihood_rolling`: the text in lm-eval's rolling windows of the model's context,
  each window scored by `decode.score`.
- `generate_until`: speculative generation with the drafter (`draft`: a draft model, a
  head, "ngram", or none: autoregressive), the requests of one setting in one call
  through `batch_size` slots; `max_gen_toks` (default 256), `temperature` (0, greedy, by
  default; `do_sample=False` forces it) and the `until` strings of each request. A row
  stops at the model's stop ids and at its `until` strings' own tokenizations inside the
  program; the text is cut at the first `until` string on the host (`stop_strings.cut`).
  Request i's key is fold_in(key(seed), i), whatever the batching.
"""

from __future__ import annotations

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jax_specdec import stop_strings
from jax_specdec.decode import Generator, score
from jax_specdec.sampling import SamplingConfig

__all__ = ["JaxSpecdecLM"]


@register_model("jax_specdec", "jax-specdec")
class JaxSpecdecLM(TemplateLM):
    """A target (and its drafter) as an lm-eval model. Arguments (`--model_args`): `target`
    (a directory, .gguf, Hub id or zoo name), `draft` (as `generate --draft`; none:
    autoregressive), `num_draft_tokens` ("auto", the default: `schedules.Auto`; or γ),
    `tree` (nodes: on auto's menu, or every round at depth γ; none: chains), `batch_size`
    (default 8; also lm-eval's `--batch_size`), `max_length` (default the models'
    context), `dtype`, `seed` (default 0). lm-eval's `device` and `max_batch_size` are
    taken and not used: JAX places the arrays on its default device."""

    def __init__(
        self,
        target: str,
        draft: str | None = None,
        num_draft_tokens: int | str = "auto",
        tree: int | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        dtype: str | None = None,
        seed: int = 0,
        device: str | None = None,
        max_batch_size: int | None = None,
        **unused,
    ) -> None:
        super().__init__()
        from jax_specdec.io.draft import context, load_pair
        from jax_specdec.io.hf import load_model, load_tokenizer, stop_token_ids
        from jax_specdec.io.locate import locate
        from jax_specdec.settings import check_gamma_flag

        if unused:
            raise ValueError(f"jax_specdec: unknown model_args {sorted(unused)}")
        self.gamma = check_gamma_flag(num_draft_tokens, "num_draft_tokens")
        if draft in (None, "", "none"):
            directory = locate(target, "target")
            self.model, self.drafter = load_model(directory, dtype=dtype), None
            self.tokenizer = load_tokenizer(directory)
        else:
            loaded = load_pair(target, draft, dtype=dtype)
            self.model, self.drafter, self.tokenizer = loaded.target, loaded.draft, loaded.tokenizer
            directory = loaded.target_dir
        self.stops = stop_token_ids(directory) or None
        self.tree = None if tree in (None, "") else int(tree)
        self.batch = int(batch_size) if str(batch_size) != "auto" else 8
        self.max_length = int(max_length or context(self.model, self.drafter))
        self.seed = int(seed)

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.stops[0] if self.stops else 0

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    # ------------------------------------------------------------------ scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        out = []
        for start in range(0, len(requests), self.batch):
            part = requests[start : start + self.batch]
            contexts, continuations = [], []
            for _, context_enc, continuation_enc in part:
                keep = self.max_length - len(continuation_enc)
                contexts.append(context_enc[-keep:] if keep > 0 else context_enc[-1:])
                continuations.append(continuation_enc[-(self.max_length - 1) :])
            scores = score(self.model, contexts, continuations)
            out += [(float(t), bool(g)) for t, g in zip(scores.total, scores.greedy, strict=True)]
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        results = []
        for request in requests:
            (text,) = request.args
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            pairs = [make_disjoint_window(w) for w in windows]
            total = 0.0
            for start in range(0, len(pairs), self.batch):
                part = pairs[start : start + self.batch]
                scores = score(self.model, [c for c, _ in part], [t for _, t in part])
                total += float(np.sum(scores.total))
            results.append(total)
        return results

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False):
        groups: dict[tuple, list[int]] = {}
        settings = [_settings(request.args[1]) for request in requests]
        for i, (sampling, budget, _) in enumerate(settings):
            groups.setdefault((sampling, budget), []).append(i)
        texts = [""] * len(requests)
        for (sampling, budget), indices in groups.items():
            budget = min(budget, self.max_length - 1)
            prompts = [self._prompt(requests[i].args[0], budget) for i in indices]
            keys = jax.vmap(jax.random.fold_in, (None, 0))(
                jax.random.key(self.seed), np.asarray(indices, np.uint32)
            )
            gen = self._generator(sampling)
            slots = min(self.batch, len(prompts))
            # the until strings' own tokenizations end a row inside the program
            stops = [stop_strings.token_sequences(self.tokenizer, settings[i][2]) for i in indices]
            extra = {"stop_sequences": stops} if any(stops) else {}
            out = gen(prompts, key=keys, max_new_tokens=budget, num_slots=slots, **extra)
            tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
            for row, i in enumerate(indices):
                text = self.tok_decode(
                    t for t in tokens[row, : lengths[row]] if not self.stops or t not in self.stops
                )
                texts[i] = stop_strings.cut(text, settings[i][2])[0]
        return texts

    def _prompt(self, context: str, budget: int) -> list[int]:
        """The context's ids, cut from the left to leave room for `budget` tokens."""
        ids = self.tok_encode(context) or [self.prefix_token_id]
        return ids[-(self.max_length - budget) :]

    def _generator(self, sampling: SamplingConfig) -> Generator:
        rounds = {}
        if self.drafter is not None:
            rounds = dict(schedule=self.gamma, tree=self.tree)
        return Generator(
            self.model, self.drafter, sampling=sampling, eos_token_id=self.stops, **rounds
        )


def _settings(gen_kwargs: dict) -> tuple[SamplingConfig, int, tuple[str, ...]]:
    """(sampling, max_gen_toks, until strings) of a request's generation arguments."""
    kwargs = dict(gen_kwargs)
    until = stop_strings.check(kwargs.pop("until", None) or (), "generate_until: 'until'")
    budget = int(kwargs.pop("max_gen_toks", 256))
    temperature = float(kwargs.pop("temperature", 0.0))
    if kwargs.pop("do_sample", None) is False:
        temperature = 0.0
    sampling = SamplingConfig(
        temperature,
        top_k=int(kwargs.pop("top_k", 0) or 0),
        top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
    )
    return sampling, budget, until
