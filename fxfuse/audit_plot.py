"""Small output helpers of ``fxfuse audit``: a progress bar on stderr and the PNG of memory and loss curves.

Neither needs a dependency beyond the standard library; the PNG needs matplotlib (the optional extra
``fxfuse[audit]``) and says so, without failing the audit, when it is missing.
"""
from __future__ import annotations

import sys
import time


class Progress:
    """``label [#######.......]  12/200  3.1 s  <note>`` on stderr.

    On a terminal the line is redrawn in place (at most ~10 times a second); otherwise (logs, CI,
    a parent process reading the pipe) one line is printed at every 10% and at the end, so long runs
    show progress without flooding a log file.
    """

    def __init__(self, total: int, label: str, stream=None, width: int = 28):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, done: int, note: str = "") -> None:
        now = time.perf_counter()
        frac = min(1.0, done / self.total)
        filled = int(round(frac * self.width))
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done:>{len(str(self.total))}}/"
                f"{self.total}  {now - self.t0:6.1f} s  {note}")
        if self.tty:
            if now - self._last_draw >= 0.1 or done >= self.total:
                self.stream.write("\r" + line.ljust(100)[:160])
                self._last_draw = now
                if done >= self.total:
                    self.stream.write("\n")
        else:
            decile = int(frac * 10)
            if decile != self._last_decile:
                self.stream.write(line + "\n")
                self._last_decile = decile
        self.stream.flush()


def plot_png(results: dict, path: str, mem_label: str) -> str:
    """Write loss and per-step memory curves of every mode that ran to ``path``.

    results: mode -> worker result dict (``losses``: list[float], ``mem_curve_mib``: list[float]).
    Returns a one-line status for the console ("wrote ..." or why nothing was written).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "PNG plot skipped: matplotlib is not installed (pip install 'fxfuse[audit]')"
    ran = {m: r for m, r in results.items() if r.get("losses")}
    if not ran:
        return "PNG plot skipped: no mode produced a loss curve"
    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, r in ran.items():
        steps = range(1, len(r["losses"]) + 1)
        ax_loss.plot(steps, r["losses"], label=mode)
        if r.get("mem_curve_mib"):
            ax_mem.plot(range(1, len(r["mem_curve_mib"]) + 1), r["mem_curve_mib"], label=mode)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_mem.set(xlabel="step", ylabel="MiB", title=mem_label)
    for ax in (ax_loss, ax_mem):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
