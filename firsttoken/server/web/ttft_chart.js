// The last replies' client-measured TTFTs as bars on a canvas, with their P50 and P99 as lines.

const DEFAULT_CAPACITY = 50;
const PADDING = { top: 14, right: 84, bottom: 6, left: 6 };

// The nearest-rank percentile (q in [0, 100]) of a non-empty list of numbers.
export function percentile(values, q) {
  const sorted = [...values].sort((a, b) => a - b);
  const rank = Math.ceil((q / 100) * sorted.length);
  return sorted[Math.min(sorted.length, Math.max(1, rank)) - 1];
}

export function formatMs(ms) {
  return ms >= 100 ? `${Math.round(ms)} ms` : `${ms.toFixed(1)} ms`;
}

// Owns the kept TTFTs (milliseconds, oldest first) and draws them.
export class TtftChart {
  constructor(canvas, summary, capacity = DEFAULT_CAPACITY) {
    this.canvas = canvas;
    this.summary = summary;
    this.capacity = capacity;
    this.values = [];
    // Redrawn at the canvas's own size, so that it stays sharp on any screen and width.
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  add(ttftMs) {
    this.values.push(ttftMs);
    if (this.values.length > this.capacity) this.values.shift();
    this.draw();
  }

  stats() {
    if (!this.values.length) return null;
    return { count: this.values.length, p50: percentile(this.values, 50), p99: percentile(this.values, 99) };
  }

  draw() {
    const stats = this.stats();
    this.summary.textContent = stats
      ? `P50 ${formatMs(stats.p50)} · P99 ${formatMs(stats.p99)} over the last ${stats.count} ` +
        `${stats.count === 1 ? "reply" : "replies"}`
      : "No replies yet.";
    const context = this.prepareCanvas();
    if (!context || !stats) return;
    const { width, height } = this.canvas.getBoundingClientRect();
    const plot = {
      left: PADDING.left,
      top: PADDING.top,
      width: width - PADDING.left - PADDING.right,
      height: height - PADDING.top - PADDING.bottom,
    };
    const maxMs = Math.max(...this.values) * 1.1;
    const y = (ms) => plot.top + plot.height * (1 - ms / maxMs);
    const colors = getComputedStyle(this.canvas);

    const slot = plot.width / this.capacity;
    context.fillStyle = colors.getPropertyValue("--chart-bar").trim();
    this.values.forEach((ms, index) => {
      const x = plot.left + slot * (this.capacity - this.values.length + index);
      context.fillRect(x + 1, y(ms), Math.max(1, slot - 2), plot.top + plot.height - y(ms));
    });
    const p50 = { y: y(stats.p50), labelY: y(stats.p50) };
    // P99 >= P50, so its line is never below; its label moves up when the two would overlap.
    const p99 = { y: y(stats.p99), labelY: Math.max(6, Math.min(y(stats.p99), p50.y - 12)) };
    this.drawLine(context, plot, p50, colors.getPropertyValue("--chart-p50").trim(), `P50 ${formatMs(stats.p50)}`);
    this.drawLine(context, plot, p99, colors.getPropertyValue("--chart-p99").trim(), `P99 ${formatMs(stats.p99)}`);
  }

  // A cleared context scaled to CSS pixels; null while the canvas is not laid out (hidden).
  prepareCanvas() {
    const { width, height } = this.canvas.getBoundingClientRect();
    if (!width || !height) return null;
    const ratio = window.devicePixelRatio || 1;
    this.canvas.width = Math.round(width * ratio);
    this.canvas.height = Math.round(height * ratio);
    const context = this.canvas.getContext("2d");
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    context.clearRect(0, 0, width, height);
    return context;
  }

  drawLine(context, plot, { y, labelY }, color, label) {
    context.strokeStyle = color;
    context.fillStyle = color;
    context.lineWidth = 1.5;
    context.setLineDash([5, 3]);
    context.beginPath();
    context.moveTo(plot.left, y);
    context.lineTo(plot.left + plot.width, y);
    context.stroke();
    context.setLineDash([]);
    context.font = "11px system-ui, sans-serif";
    context.textBaseline = "middle";
    context.fillText(label, plot.left + plot.width + 4, labelY);
  }
}
