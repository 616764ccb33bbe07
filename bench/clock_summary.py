"""Summary of a clock log written by bench/device.sh (nvidia-smi --query-gpu=timestamp,index,
clocks.sm,power.draw,temperature.gpu --format=csv,noheader): per GPU, the SM clock's median,
minimum and the share of samples below 95 % of its maximum, and the power and temperature peaks.

    python3 bench/clock_summary.py clocks.csv
"""
import statistics
import sys


def parse(lines):
    """{gpu index: [(sm MHz, power W, temperature C), ...]} from the log's lines; lines that do not
    parse (a sample cut off when the logger was stopped) are left out."""
    gpus = {}
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5:
            continue
        try:
            index = int(fields[1])
            sm = float(fields[2].split()[0])
            power = float(fields[3].split()[0])
            temperature = float(fields[4].split()[0])
        except (ValueError, IndexError):
            continue
        gpus.setdefault(index, []).append((sm, power, temperature))
    return gpus


def summary(gpus):
    """One line per GPU."""
    out = []
    for index in sorted(gpus):
        samples = gpus[index]
        sm = [s[0] for s in samples]
        busy = [s for s in samples if s[1] > 200.0]  # under load (idle H200s draw ~75-120 W)
        busy_sm = [s[0] for s in busy] or sm
        top = max(busy_sm)
        low = sum(1 for v in busy_sm if v < 0.95 * top) / len(busy_sm)
        out.append(f"GPU {index}: {len(samples)} samples, {len(busy)} under load; SM MHz under load "
                   f"median {statistics.median(busy_sm):.0f}, min {min(busy_sm):.0f}, max {top:.0f}, "
                   f"{100 * low:.0f} % below 95 % of max; power max {max(s[1] for s in samples):.0f} W; "
                   f"temperature max {max(s[2] for s in samples):.0f} C")
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        lines = summary(parse(f))
    print("\n".join(lines) if lines else f"{sys.argv[1]}: no samples")


if __name__ == "__main__":
    main()
