"""Human-readable reports and the output measures quoted beside acceptance."""

from __future__ import annotations

from collections.abc import Sequence


def repetition(tokens: Sequence[int], n: int = 4) -> float:
    """Share of repeated n-grams (1 - distinct/total): degenerate loops inflate acceptance."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def _mib(n: object) -> str:
    return f"{int(n) / 2**20:.1f} MiB" if isinstance(n, int) else "-"


def summary_lines(r: dict) -> list[str]:
    lines = [
        f"model          {r['model']}",
        f"compressor     {r['compressor']}  (horizon {r['horizon']})",
        f"prompt         {r['prompt_tokens']} tokens, prefill {r['prefill_s']} s"
        + (f", {r['prefix_tokens_reused']} reused from the store" if r.get("prefix_tokens_reused") else ""),
        f"generated      {r['generated_tokens']} tokens ({r['finish_reason']}), {r['tokens_per_second']} tok/s",
        f"acceptance     {r['mean_accepted_length']} tokens per verification over {r['verify_passes']} "
        f"passes (drafts accepted {100 * r['acceptance_rate']:.1f}%), repetition {r['repetition']}",
        f"KV bytes       full {_mib(r['full_kv_bytes'])}, compressed {_mib(r['compressed_kv_bytes'])}, "
        f"fetched {_mib(r['fetch_bytes_per_verify'])} per verification (waited {r['fetch_wait_s']} s in all)",
    ]
    if r.get("identical") is not None:
        lines.append(
            f"vs full KV     identical={r['identical']} (max |logit diff| {r['max_logit_abs_diff']:.2e}); "
            f"full-KV decoding {r['full']['tokens_per_second']} tok/s"
        )
    if "lossy" in r:
        lossy = r["lossy"]
        verdict = ""
        if "identical" in lossy:
            verdict = "identical" if lossy["identical"] else f"diverges at token {lossy['first_mismatch']}"
        lines.append(f"lossy          {verdict} ({lossy['tokens_per_second']} tok/s)")
    lines += ["", "--- VeriCache output ---", r["text"]]
    if "lossy" in r:
        lines += ["", "--- lossy output (compressed KV alone) ---", r["lossy"]["text"]]
    return lines
