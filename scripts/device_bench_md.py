"""device_bench.md from device_bench.json's result (scripts/device_bench.py)."""

from __future__ import annotations

from device_bench_8b import markdown as markdown_8b


def markdown(result: dict) -> str:
    lines = [f"# device_bench ({result['device']}, {result['dtype']})", ""]
    lines += [f"Parameters: {result['parameters']}", "", "## Step cost (SmolLM2-135M shapes)", ""]
    steps = result["steps"]
    lines.append("bare weight matmuls (ms): " + ", ".join(
        f"batch {b}: {ms:.2f}" for b, ms in steps["bare_ms"].items()))  # fmt: skip
    lines += ["", "| batch | tokens per row | allocated cache | context | ms | vs 1-token step "
              "| vs bare matmuls |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    order = lambda r: (r["batch"], r["cache_len"], r["context"], r["tokens"])  # noqa: E731
    for r in sorted(steps["rows"], key=order):
        one = "" if r["vs_one_token"] is None else f"{r['vs_one_token']:.2f}"
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['cache_len']} | {r['context']} | "
                     f"{r['ms']:.2f} | {one} | {r['vs_bare']:.2f} |")  # fmt: skip
    lines += ["", "## Speculative vs autoregressive (temperature 1)", ""]
    lines += ["| model | batch | method | tokens/s | speedup | α |", "|---|---|---|---|---|---|"]
    for r in result["generation"]:
        alpha = f"{r['alpha']:.3f}" if "alpha" in r else ""
        lines.append(f"| {r['model']} | {r['batch']} | {r['method']} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {alpha} |")  # fmt: skip
    lines += ["", "## Attention kernels", "", "| kernel | batch | tokens | cache | context | ms |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["kernels"]:
        ms = f"{r['ms']:.2f}" if "ms" in r else r["error"]
        lines.append(f"| {r['kernel']} | {r['batch']} | {r['tokens']} | {r['cache_len']} | "
                     f"{r['context']} | {ms} |")  # fmt: skip
    lines += ["", "## Per-row sampling transforms", "",
              "| transform | logits | ms | vs one setting |", "|---|---|---|---|"]  # fmt: skip
    for r in result["sampling"]:
        ratio = "" if r["vs_one_setting"] is None else f"{r['vs_one_setting']:.2f}"
        lines.append(f"| {r['transform']} | [{r['rows']}, {r['tokens']}, {r['vocab']}] | "
                     f"{r['ms']:.3f} | {ratio} |")  # fmt: skip
    lines += markdown_8b(result.get("load_8b", {}))
    if result["skipped"]:
        lines += ["", "Skipped (budget spent): " + "; ".join(result["skipped"])]
    lines += ["", f"Wall time {result['wall_s']:.0f} s."]
    return "\n".join(lines) + "\n"
