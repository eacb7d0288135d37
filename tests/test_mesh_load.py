"""Loading a checkpoint straight onto a mesh (`load_model(path, mesh=...)`), on 8
simulated CPU devices in a subprocess (tests/mesh_load_run.py): every parameter leaves
the loader with its final sharding, KV heads are repeated where the model axis is wider
than them, the tokens are the one-device load's, and the host never holds the sharded
weights whole (peak memory within 1.3x a 2.2 GB bfloat16 checkpoint's size)."""

import json
import pathlib
import subprocess
import sys

import pytest

from jax_specdec.bench.random_checkpoint import LLAMA_1B, write_llama_checkpoint

HERE = pathlib.Path(__file__).parent


def run(*args, timeout=900):
    proc = subprocess.run(
        [sys.executable, str(HERE / "mesh_load_run.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def save_transformers(directory, arch):
    """A random model saved by `transformers`: 8 query heads, 2 KV heads (Llama, Qwen3),
    or GPT-2's fused q/k/v (read whole, then placed by slices)."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=64, num_attention_heads=8)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_positions=64, n_head=8)
        model = transformers.GPT2LMHeadModel(config)
    else:
        cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
        config = cls(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=arch == "qwen3",
            **common,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_every_parameter_placed_and_the_one_device_tokens(tmp_path):
    from gguf_files import write_gguf

    dirs = [save_transformers(tmp_path / arch, arch) for arch in ("llama", "qwen3", "gpt2")]
    gguf = write_gguf(tmp_path / "q8.gguf", "llama", "Q8_0")  # 4 heads: (2, 4) only
    result = run("tokens", *dirs, gguf)
    assert len(result) == 7
    for name, r in result.items():
        assert r["wrong"] == [], f"{name}: placed otherwise than planned: {r['wrong']}"
        assert r["same"] and r["same_resharded"], f"{name}: tokens differ from one device's"
        assert r["kept"], f"{name}: the Generator copied parameters already on the mesh"
    assert result["llama (1, 8)"]["kv_heads"] == [2, 8]  # each KV head on 4 devices
    assert result["llama (2, 4)"]["kv_heads"] == [2, 4]
    assert result["gpt2 (1, 8)"]["kv_heads"] == [8, 8]
    assert result["q8.gguf (2, 4)"]["kv_heads"] == [2, 4]  # dequantized whole, placed by slices


@pytest.mark.slow
def test_peak_host_memory_stays_within_1_3x_the_checkpoint(tmp_path):
    """Loading a 2.2 GB bfloat16 checkpoint onto a (1, 8) mesh, the process's memory
    grows by at most 1.3x the checkpoint's size at its peak; whole tensors resharded (the
    path the sliced loader replaces: the model whole on device 0 beside its sharded copy)
    peak higher by more than 0.3x (measured here: 0.8-1.12x against 1.38-1.70x; simulated
    devices share some buffers with the host arrays they were made from, so the figures
    move between runs, their difference much less). On (2, 4), whose devices hold each
    weight twice (simulated CPU devices hold them in host memory), the peak stays within
    1.3x what the devices hold."""
    size = write_llama_checkpoint(tmp_path / "big", LLAMA_1B)  # a 1.1B Llama's shapes
    assert size > 2e9
    runs = {
        "sliced 1x8": run("memory", tmp_path / "big", "sliced", "1x8"),
        "whole 1x8": run("memory", tmp_path / "big", "whole", "1x8"),
        "sliced 2x4": run("memory", tmp_path / "big", "sliced", "2x4"),
    }
    grew = {k: (r["peak"] - r["before"]) / size for k, r in runs.items()}
    print(f"\nPEAK HOST MEMORY GROWTH / CHECKPOINT ({size / 1e9:.2f} GB): {grew}")
    assert runs["sliced 1x8"]["devices"] < 1.05 * size  # every weight split, none whole
    assert grew["sliced 1x8"] <= 1.3, grew
    assert grew["whole 1x8"] - grew["sliced 1x8"] > 0.3, grew  # the measure sees it
    assert grew["sliced 2x4"] * size <= 1.3 * runs["sliced 2x4"]["devices"], grew
