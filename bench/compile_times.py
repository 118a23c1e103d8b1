"""Where torch.compile spent its time in a training run: runs a train script, then prints Dynamo's
timers by phase (graphs compiled, tracing, AOTAutograd, inductor) as the run ends, and writes them
to $OUT/compile_times.txt where OUT is set.

    torchrun --nproc_per_node=1 bench/compile_times.py train_grpo.py --model ... [flags]

COMPILE_WORKERS_AT_LAUNCH=1 starts inductor's pool of compile workers (the processes that build
Triton kernels) before the script runs, rather than at the first compile.
"""

import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def summary():
    from bench.profile_step import compile_summary

    text = compile_summary(top=25)
    print(text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "compile_times.txt"), "w") as f:
            f.write(text + "\n")


def main():
    if os.environ.get("COMPILE_WORKERS_AT_LAUNCH") == "1":
        import torch._inductor.config as inductor_config
        from torch._inductor.async_compile import maybe_warm_pool

        inductor_config.quiesce_async_compile_time = 600  # kept up until the first compile
        maybe_warm_pool()
    # the train scripts end with os._exit (no interpreter teardown, no atexit)
    exit_now = os._exit

    def exit_after_summary(code):
        summary()
        exit_now(code)

    os._exit = exit_after_summary
    sys.argv = sys.argv[1:]
    runpy.run_path(os.path.join(ROOT, sys.argv[0]), run_name="__main__")


if __name__ == "__main__":
    main()
