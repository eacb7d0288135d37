"""Hugging Face Hub ids (`org/name`, optionally `@revision`) as local snapshots, through
`huggingface_hub` and the user's own cache and settings (`HF_HOME`, `HF_HUB_CACHE`,
`HF_TOKEN`, `HF_HUB_OFFLINE`). Only the files a load reads are fetched."""

from __future__ import annotations

import pathlib
import re

__all__ = ["HUB_FILES", "hub_snapshot", "is_hub_id"]

# What a load reads from a Hub repository: configs, weights and their index, tokenizer
# files, a head's config and measured tree acceptance (not the repository's other
# files: README, other formats).
HUB_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "head_config.json",
    "tree_acceptance.json",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a Hub id, `org/name` or `org/name@revision`."""
    return bool(_HUB_ID.match(text))


def hub_snapshot(hub_id: str, which: str) -> pathlib.Path:
    """The local snapshot of Hub repository `hub_id` (`org/name[@revision]`) holding the
    files a load needs (`HUB_FILES`), downloaded with a progress bar where missing.
    ValueError in one line, naming `which`, when it cannot be had."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, _, revision = hub_id.partition("@")
    try:
        return pathlib.Path(
            snapshot_download(repo, revision=revision or None, allow_patterns=list(HUB_FILES))
        )
    except LocalEntryNotFoundError:
        raise ValueError(
            f"--{which}: {hub_id} is neither a local directory nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and the Hub cannot be reached (offline, or "
            f"HF_HUB_OFFLINE=1): download it where the Hub is reachable (`hf download {repo}`) "
            "into this cache, or give a local directory"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(
            f"--{which}: {hub_id} is not a Hub model this account can read ({type(e).__name__}"
            "; a gated or private model needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"--{which}: {repo} has no revision {revision!r}") from None
    except HfHubHTTPError as e:
        raise ValueError(
            f"--{which}: fetching {hub_id} failed ({str(e).splitlines()[0]})"
        ) from None
