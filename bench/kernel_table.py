"""Condenses the torch profiler tables of bench/one_step.py --profile: per step, each kernel's
summed device time, share and call count, one line each.
    python3 bench/kernel_table.py profile.txt"""
import sys


def main(path):
    for line in open(path):
        if "kernels by device time" in line:
            print(line.strip())
            continue
        if "epmoe::" not in line:
            continue
        # the last 10 fields: Self CPU %, Self CPU, CPU total %, CPU total, CPU time avg, Self CUDA,
        # Self CUDA %, CUDA total, CUDA time avg, # of Calls; the name is the rest
        fields = line.split()
        if len(fields) < 11:
            continue
        name, cols = " ".join(fields[:-10]), fields[-10:]
        name = name.replace("epmoe::cuda::", "").replace("gemm::", "").replace("(anonymous namespace)::", "")
        print(f"  {name[:110]:110s} {cols[5]:>10s} {cols[6]:>7s} x{cols[9]}")


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BrokenPipeError:  # a reader such as head stopped early
        sys.stderr.close()
