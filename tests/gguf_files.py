"""Small random GGUF files for the tests, written with `gguf.GGUFWriter` as llama.cpp does.

`write_gguf(path, arch, qtype)` writes a 2-layer model whose 2-D weights are stored as
`qtype` and whose tokenizer is a small byte-level BPE vocabulary; llama files get
their q/k rows permuted as llama.cpp's converter permutes them.
"""

from __future__ import annotations

import numpy as np

# arch -> (gguf architecture, general.name, tokenizer.ggml.pre, d, heads, kv heads, head_dim)
SHAPES = {
    "llama": ("llama", "tiny-llama", "default", 256, 4, 2, 64),
    "qwen2": ("qwen2", "tiny-qwen2", "qwen2", 256, 4, 2, 64),
    # llama.cpp stores Mistral models as llama; transformers (5.24) then builds a Llama.
    "mistral": ("llama", "Mistral-tiny", "llama-bpe", 256, 4, 1, 32),
}
MLP, LAYERS, CONTEXT = 512, 2, 64
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ d", "Ġd e", "Ġde f", "o n", "1 2"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Offsets of the float16 scale fields in one block of the k-quants, which gguf-py cannot
# quantize: random blocks are written instead, scaled to a small weight magnitude.
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def byte_alphabet() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def vocabulary() -> tuple[list[str], list[int]]:
    tokens = byte_alphabet() + ["".join(m.split(" ")) for m in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), written out here."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def hf_weights(arch: str, rng: np.random.Generator, tie: bool) -> dict[str, np.ndarray]:
    """Random weights under their GGUF names, in Hugging Face layout ([out, in])."""
    _, _, _, d, heads, kv, hd = SHAPES[arch]
    vocab = len(vocabulary()[0])

    def w(*shape, scale=0.2):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    out = {"token_embd.weight": w(vocab, d, scale=1.0), "output_norm.weight": 1 + w(d)}
    if not tie:
        out["output.weight"] = w(vocab, d)
    for i in range(LAYERS):
        b = f"blk.{i}."
        out |= {
            b + "attn_norm.weight": 1 + w(d),
            b + "ffn_norm.weight": 1 + w(d),
            b + "attn_q.weight": w(heads * hd, d),
            b + "attn_k.weight": w(kv * hd, d),
            b + "attn_v.weight": w(kv * hd, d),
            b + "attn_output.weight": w(d, heads * hd),
            b + "ffn_gate.weight": w(MLP, d),
            b + "ffn_up.weight": w(MLP, d),
            b + "ffn_down.weight": w(d, MLP),
        }
        if arch == "qwen2":
            out |= {
                b + f"attn_{x}.bias": w(n * hd) for x, n in zip("qkv", (heads, kv, kv), strict=True)
            }
    return out


def encode(name: str, array: np.ndarray, qtype: str, rng: np.random.Generator):
    """(data, raw_dtype) for GGUFWriter.add_tensor: 1-D tensors stay float32."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    if array.ndim == 1 or qtype == "F32":
        return array, None
    t = T[qtype]
    if qtype == "F16":
        return array.astype(np.float16), None
    if qtype not in K_SCALES:
        return quantize(array, t), t
    block, size = GGML_QUANT_SIZES[t]
    rows, cols = array.shape
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def dequant(*scales):  # the weights are linear in the block's float16 scale fields
        for offset, value in zip(K_SCALES[qtype], scales, strict=True):
            field = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
            data[:, :, offset : offset + 2] = field
        return dequantize(data.reshape(rows, -1), t)

    if len(K_SCALES[qtype]) == 2:  # w = d * scale * q - dmin * min: pick dmin for mean 0
        ratio = float(dequant(1.0, 0.0).mean() / -dequant(0.0, 1.0).mean())
        scales = np.array([1.0, ratio])
    else:
        scales = np.array([1.0])
    rms = float(np.sqrt(np.mean(dequant(*scales) ** 2)))
    dequant(*(scales * 0.2 / rms))
    return data.reshape(rows, -1), t


def write_gguf(
    path,
    arch: str,
    qtype: str,
    *,
    seed: int = 0,
    tie: bool | None = None,
    pre: str | None = None,
    tokenizer_model: str = "gpt2",
    gguf_arch: str | None = None,
    head_count: int | None = None,
    skip: tuple[str, ...] = (),
):
    """Write a random `arch` model with 2-D weights stored as `qtype`; returns `path`.
    `head_count` overrides the stated number of heads; `skip` names tensors left out."""
    import gguf

    rng = np.random.default_rng(seed)
    real_arch, name, default_pre, d, heads, kv, hd = SHAPES[arch]
    tie = arch != "llama" if tie is None else tie
    gguf_arch = gguf_arch or real_arch
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_name(name)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(d)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(MLP)
    writer.add_head_count(heads if head_count is None else head_count)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(500.0 if arch == "llama" else 20000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if real_arch == "llama":
        writer.add_rope_dimension_count(hd)
    tokens, types = vocabulary()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre or default_pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    for tensor, array in hf_weights(arch, rng, tie).items():
        if tensor in skip:
            continue
        if real_arch == "llama" and ".attn_q." in tensor:
            array = llama_cpp_permute(array, heads)
        elif real_arch == "llama" and ".attn_k." in tensor:
            array = llama_cpp_permute(array, kv)
        data, raw = encode(tensor, array, qtype, rng)
        writer.add_tensor(tensor, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
