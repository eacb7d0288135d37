"""Orbax checkpoints: bit-identical round trip, sharded restore, bad directories."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_specdec.io.checkpoint import restore_checkpoint, save_checkpoint
from jax_specdec.nn import Transformer, TransformerConfig


def flat_params(model):
    return {
        path: np.asarray(leaf.get_value()) for path, leaf in nnx.to_flat_state(nnx.state(model))
    }


@pytest.mark.parametrize(
    "config",
    [
        TransformerConfig.tiny(vocab_size=9),
        TransformerConfig.gpt2(
            vocab_size=9,
            d_model=16,
            num_layers=1,
            num_heads=2,
            max_len=16,
            dtype="bfloat16",
            param_dtype="bfloat16",
        ),
    ],
    ids=["llama_f32", "gpt2_bf16"],
)
@pytest.mark.slow
def test_round_trip_is_bit_identical(config, tmp_path):
    model = Transformer(config, rngs=nnx.Rngs(3), init_scale=0.3)
    save_checkpoint(model, tmp_path / "ckpt")
    restored = restore_checkpoint(tmp_path / "ckpt")
    assert restored.config == config
    before, after = flat_params(model), flat_params(restored)
    assert before.keys() == after.keys()
    for path in before:
        assert before[path].dtype == after[path].dtype
        np.testing.assert_array_equal(before[path], after[path], err_msg=str(path))
    tokens = jnp.array([[1, 2, 3, 4]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(restored(tokens)))
    # Saving again over the same directory works.
    save_checkpoint(restored, tmp_path / "ckpt")


def test_restore_with_sharding(tmp_path):
    model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
    save_checkpoint(model, tmp_path)
    device = jax.devices()[0]
    single = jax.sharding.SingleDeviceSharding(device)
    restored = restore_checkpoint(tmp_path, sharding=single)
    assert restored.embed[...].sharding == single
    seen = []

    def by_path(path, leaf):
        seen.append(path)
        return single

    restored = restore_checkpoint(tmp_path, sharding=by_path)
    assert ("blocks", 1, "mlp", "down", "kernel") in seen
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tree = jax.tree.map(lambda _: replicated, nnx.state(model))
    restored = restore_checkpoint(tmp_path, sharding=tree)
    np.testing.assert_array_equal(np.asarray(restored.embed[...]), np.asarray(model.embed[...]))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        restore_checkpoint(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        restore_checkpoint(tmp_path / "empty")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's threads
def test_corrupt_checkpoint(tmp_path):
    model = Transformer(TransformerConfig.tiny(), rngs=nnx.Rngs(0))
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        restore_checkpoint(tmp_path)
    # A config that does not match the saved state.
    (tmp_path / "config.json").write_text(json.dumps({**config, "d_model": 64}))
    with pytest.raises(ValueError, match="restore"):
        restore_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for file in (tmp_path / "state").rglob("*"):
        if file.is_file():
            file.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="restore"):
        restore_checkpoint(tmp_path)
