"""Tables for the terminal and PNG plots for the docs, from the plain rows the benchmarks write."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

MB = 2**20


def format_rounds(rows: list[dict]) -> str:
    head = (f"{'N':>4} {'rd':>2} {'mode':<11}{'round s':>8}{'1st tok':>8}{'TTFT s':>8}{'decode s':>9}{'rd MB/step':>11}"
            f"{'computed':>9}{'in prompts':>11}{'KV MB/agent':>12}{'compr':>6}{'shared x':>9}{'top1':>6}{'KL':>7}{'same':>6}{'trace':>6}{'div tie/conf':>13}")
    lines = [head]
    for r in rows:
        f, t = r.get("fidelity") or {}, r.get("trace") or {}
        lines.append(
            f"{r['agents']:>4} {r['round']:>2} {r['mode']:<11}{r['round_seconds']:>8.2f}"
            f"{r.get('first_token_seconds', 0):>8.2f}{r['prefill_seconds']:>8.2f}{r['decode_seconds']:>9.2f}{r.get('decode_kv_mb_per_step', 0):>11.1f}"
            f"{r['computed_tokens']:>9.0f}{r['prompt_tokens']:>11}{r['kv_bytes_per_agent'] / MB:>12.2f}{r['compression']:>6.2f}{r['shared_compression']:>9.2f}"
            f"{_num(f.get('top1_agreement'), 6, 2)}{_num(f.get('mean_kl'), 7, 3)}{_num(f.get('identical_fraction'), 6, 2)}"
            f"{_num(t.get('identical_outputs'), 6, 2)}{_divergences(f):>13}")
    return "\n".join(lines)


def _divergences(fidelity: dict) -> str:
    """Outputs that part from the reference at a near tie / confidently (reference margin > 2 nats)."""
    if fidelity.get("confident_divergences") is None:
        return "-"
    return f"{fidelity['near_tie_divergences']}/{fidelity['confident_divergences']}"


def format_sweep(rows: list[dict]) -> str:
    lines = [f"{'selection':<17}{'ratio':>6}{'rd':>3}{'TTFT s':>8}{'vs full':>8}{'shared x':>9}{'diff blk':>9}"
             f"{'top1':>6}{'KL':>7}{'same':>6}{'div tie/conf':>13}"]
    for r in rows:
        f = r["fidelity"]
        lines.append(
            f"{r['selection']:<17}{r['ratio']:>6.2f}{r['round']:>3}{r['prefill_seconds']:>8.2f}"
            f"{r['full_prefill_seconds'] / r['prefill_seconds']:>7.2f}x{r['shared_compression']:>9.2f}{r['diff_blocks']:>9}"
            f"{f['top1_agreement']:>6.2f}{f['mean_kl']:>7.3f}{f['identical_fraction']:>6.2f}{_divergences(f):>13}")
    return "\n".join(lines)


def format_cost(rows: list[dict]) -> str:
    """Each prepared round's compute by kind beside its bound (full-model token equivalents)."""
    lines = [f"{'N':>4} {'rd':>2} {'mode':<11}{'new shared':>11}{'again':>7}{'private':>8}{'recomp':>7}{'check':>7}"
             f"{'last':>6}{'total':>8}{'bound':>8}{'x bound':>8}"]
    for r in rows:
        c = r.get("cost")
        if not c:
            continue
        total = c["new_shared"] + c["shared_again"] + c["private"] + c["recomputed"] + c["check"] + c["last"]
        lines.append(f"{r['agents']:>4} {r['round']:>2} {r['mode']:<11}{c['new_shared']:>11}{c['shared_again']:>7}"
                     f"{c['private']:>8}{c['recomputed']:>7}{c['check']:>7.0f}{c['last']:>6}{total:>8.0f}{c['bound']:>8.0f}"
                     f"{total / max(1.0, c['bound']):>8.2f}")
    return "\n".join(lines)


def format_roofline(rows: list[dict]) -> str:
    """Each round against the machine (model/roofline.py): per kind of forward its work, the time
    it took, the least time the machine needs for it (max of FLOPs at the GEMM peak and bytes at
    the memory bandwidth) and the efficiency; then the round's sampler, other time and efficiency."""
    peaks = next((r["peaks"] for r in rows if r.get("peaks")), None)
    if peaks is None:
        return ""
    gemm, bandwidth = peaks["gemm_flops"], peaks["bandwidth"]
    lines = [f"peaks: GEMM {gemm / 1e9:.0f} GFLOP/s ({peaks['dtype']}, {peaks['num_threads']} threads), "
             f"memory {bandwidth / 1e9:.1f} GB/s",
             f"{'N':>4} {'rd':>2} {'mode':<11}{'kind':<8}{'rows':>7}{'lin GF':>8}{'attn GF':>8}{'MB':>8}{'s':>7}"
             f"{'roof s':>7}{'eff':>6}"]
    for r in rows:
        work = r.get("work")
        if not work:
            continue
        where = f"{r['agents']:>4} {r['round']:>2} {r['mode']:<11}"
        for kind, w in work["kinds"].items():
            if not w["rows"]:
                continue
            roof = max((w["linear_flops"] + w["attention_flops"]) / gemm, (w["weight_bytes"] + w["kv_bytes"]) / bandwidth)
            lines.append(f"{where}{kind:<8}{w['rows']:>7}{w['linear_flops'] / 1e9:>8.0f}{w['attention_flops'] / 1e9:>8.0f}"
                         f"{(w['weight_bytes'] + w['kv_bytes']) / 1e6:>8.0f}{w['seconds']:>7.2f}{roof:>7.2f}"
                         f"{roof / max(w['seconds'], 1e-9):>6.0%}")
        lines.append(f"{where}{'round':<8}{'':>31}{r['round_seconds']:>7.2f}{r['roofline_seconds']:>7.2f}"
                     f"{r['efficiency']:>6.0%}  (sampler {r['sampling_seconds']:.2f} s, other {r['other_seconds']:.2f} s, "
                     f"{work['forwards']} forwards)")
    return "\n".join(lines)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _num(value, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def steady_state(rows: list[dict], from_round: int) -> dict[tuple[int, str], dict]:
    """Per (agents, mode): means over rounds >= from_round (or the last round if there are fewer);
    None for a figure no picked round reports (a server's rows have no compression)."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["agents"], r["mode"])].append(r)
    out = {}
    for key, group in groups.items():
        last = max(r["round"] for r in group)
        picked = [r for r in group if r["round"] >= min(from_round, last)]
        out[key] = {}
        for k in ("round_seconds", "prefill_seconds", "decode_seconds", "kv_bytes_per_agent", "compression",
                  "shared_compression", "computed_tokens", "prompt_tokens"):
            values = [r[k] for r in picked if r.get(k) is not None]
            out[key][k] = sum(values) / len(values) if values else None
        tops = [r["fidelity"]["top1_agreement"] for r in picked if r.get("fidelity") and r["fidelity"]["top1_agreement"] is not None]
        out[key]["top1_agreement"] = sum(tops) / len(tops) if tops else None
        out[key]["rounds"] = sorted(r["round"] for r in picked)
    return out


def format_summary(rows: list[dict], from_round: int = 3) -> str:
    """Speed-up and memory ratios of tokendance against each baseline, per number of agents."""
    means = steady_state(rows, from_round)
    lines = []
    for n in sorted({n for n, _ in means}):
        td = means.get((n, "tokendance"))
        if td is None:
            continue
        parts = []
        for base in ("prefix", "pic", "full"):
            b = means.get((n, base))
            if b:
                parts.append(f"vs {base}: round {b['round_seconds'] / td['round_seconds']:.2f}x faster, "
                             f"TTFT {b['prefill_seconds'] / td['prefill_seconds']:.2f}x, "
                             f"KV/agent {b['kv_bytes_per_agent'] / td['kv_bytes_per_agent']:.2f}x less")
        rounds = ",".join(map(str, td["rounds"]))
        lines.append(f"N={n} (rounds {rounds}) tokendance " + "; ".join(parts))
    return "\n".join(lines)


STYLES = {"full": ("o", "-"), "prefix": ("s", "--"), "pic": ("^", ":"), "tokendance": ("D", "-")}  # marker, line
OTHER_STYLES = (("v", "-."), ("*", "-"), ("x", ":"), ("P", "--"))  # servers and other names


def mode_order(modes) -> list[str]:
    """Modes in the order of REUSE_MODES; any other name after them, alphabetically."""
    from tokendance.config import REUSE_MODES

    return sorted(modes, key=lambda m: (REUSE_MODES.index(m) if m in REUSE_MODES else len(REUSE_MODES), m))


def caption(workload: str, agents: list[int], rounds: str, loop: str, machine: dict) -> str:
    """What a figure needs to be read alone: the workload, its size, the loop, the dtype and CPU."""
    return (f"{workload}, N = {', '.join(map(str, agents))} agents, {rounds}, {loop} loop, "
            f"{machine['dtype']}, CPU capability {machine['cpu_capability']}")


SCALING_PANELS = (  # figure, axis label, scale
    ("round_seconds", "round latency (s)", 1.0),
    ("prefill_seconds", "round TTFT: last agent's first token (s)", 1.0),
    ("kv_bytes_per_agent", "KV MB per agent", 1 / MB),
    ("shared_compression", "shared-span compression (x)", 1.0),
)


def plot_scaling(rows: list[dict], path: Path, title: str, from_round: int = 3) -> None:
    """Round latency, round TTFT, KV bytes per agent and shared-span compression against the number
    of agents, one line per mode or system (each its own marker and dashes: equal values stay
    visible), all axes from 0. A system that does not report a figure has no line in its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = steady_state(rows, from_round)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.4))
    for ax, (figure, label, scale) in zip(axes.flat, SCALING_PANELS):
        for mode in mode_order({m for _, m in means}):
            ns = sorted(n for n, m in means if m == mode and means[(n, m)][figure] is not None)
            if not ns:
                continue
            marker, line = STYLES.get(mode) or OTHER_STYLES[sorted({m for _, m in means}).index(mode) % len(OTHER_STYLES)]
            ax.plot(ns, [means[(n, mode)][figure] * scale for n in ns], marker=marker, linestyle=line, label=mode,
                    markerfacecolor="none", markersize=8)
        ax.set(xlabel="agents", ylabel=label, title=label.split(":")[0].split(" (")[0])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not reported by these systems", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fidelity(sweep: list[dict], path: Path, title: str, default_ratio: float | None = None) -> None:
    """Top-1 agreement and KL against `full` vs the recompute ratio, one line per selection, the
    default ratio marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    for number, selection in enumerate(sorted({r["selection"] for r in sweep})):
        by_ratio = defaultdict(list)
        for r in sweep:
            if r["selection"] == selection:
                by_ratio[r["ratio"]].append(r["fidelity"])
        ratios = sorted(by_ratio)
        style = dict(marker="osD^"[number % 4], linestyle=["-", "--", ":", "-."][number % 4], label=selection)
        left.plot(ratios, [_mean(f["top1_agreement"] for f in by_ratio[x]) for x in ratios], **style)
        right.plot(ratios, [_mean(f["mean_kl"] for f in by_ratio[x]) for x in ratios], **style)
    left.set(xlabel="recompute ratio", ylabel="top-1 agreement vs full (mean over rounds)", ylim=(0, 1.05),
             title="first-token agreement with full recompute")
    right.set(xlabel="recompute ratio", ylabel="KL(full || tokendance), mean over rounds",
              title="first-token KL to full recompute")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        if default_ratio is not None:
            ax.axvline(default_ratio, color="gray", linestyle=":", label=f"default ({default_ratio:g})")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_noise_floor(report: dict) -> str:
    """The teacher-forced report: each setting against full, and as a multiple of the floor."""
    lines = [f"{report['agents']} agents, {report['rounds']} rounds, teacher-forced on full's output; "
             f"floor: {report['floor']}"]
    graded = report["reference_accuracy"] is not None
    if graded:
        low, high = report["reference_accuracy_ci"]
        lines[0] += f"; full answers {report['reference_accuracy']:.1%} right (95%: {low:.0%}-{high:.0%})"
    quality = report.get("reference_quality")
    if quality:
        lines[0] += f"; full's replies loop {quality['loop_fraction']:.0%}, distinct-2 {quality['distinct_2']:.2f}"
    lines.append(f"{'setting':<22}{'preset':>7}{'TTFT x':>7}{'shared x':>9}{'same':>6}{'top1':>7}{'KL mean':>9}{'x floor':>8}{'KL p99':>8}"
                 f"{'x floor':>8}{'flips >0.5':>11}{'>2 nats':>8}{'positions':>10}{'loops':>7}{'dist-2':>7}"
                 + (f"{'right':>7}{'95%':>10}{'changed':>8}" if graded else ""))
    for r in report["rows"]:
        lines.append(
            f"{r['setting']:<22}{r['preset']:>7}{r['ttft_speedup']:>7.2f}{r['shared_compression']:>9.2f}{r['identical_fraction']:>6.2f}"
            f"{r['top1_agreement']:>7.3f}"
            f"{r['kl_mean']:>9.4f}{_num(r['kl_mean_ratio'], 8, 1)}{r['kl_p99']:>8.3f}{_num(r['kl_p99_ratio'], 8, 1)}"
            f"{r['flips_over_half_nat']:>11}{r['flips_over_2_nats']:>8}{r['positions']:>10}"
            f"{r['loop_fraction']:>7.0%}{r['distinct_2']:>7.2f}"
            + (f"{r['task_accuracy']:>7.1%}{_span(r['task_accuracy_ci']):>10}{r['changed_answers']:>8.1%}" if graded else ""))
    return "\n".join(lines)


def _span(interval) -> str:
    return f"{interval[0]:.0%}-{interval[1]:.0%}"


def plot_noise_floor(report: dict, path: Path, title: str) -> None:
    """Mean KL to full as a multiple of the floor's against shared-span compression, one point per
    setting, the floor (1x) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for number, r in enumerate(report["rows"]):
        if r["kl_mean_ratio"] is None:
            continue
        ax.plot(r["shared_compression"], max(r["kl_mean_ratio"], 1e-3), marker="osD^vP*X"[number % 8], linestyle="none",
                markersize=9, markerfacecolor="none", label=f"{r['setting']} ({r['flips_over_half_nat']} flips > 0.5 nats)")
    ax.axhline(1.0, color="gray", linestyle=":", label="floor: full in the other dtype")
    ax.set(xlabel="shared-span compression (x)", ylabel="mean KL to full / floor's (log)", yscale="log",
           title="teacher-forced KL against the numeric noise floor")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
