"""The command line: --help by section, each flag once with its default once; a flag error in a
line naming the closest flags; verl's dotted keys taken through the table docs/flags.md is written
from, and the keys with no counterpart named."""

import dataclasses
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cli
import flags
import train_grpo
import train_ppo

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"train_grpo.py": train_grpo.Args, "train_ppo.py": train_ppo.Args}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_renders_each_flag_once_in_its_section(script, monkeypatch):
    Args = SCRIPTS[script]
    monkeypatch.setattr(sys, "argv", [script])
    text = cli.parser(Args).format_help()
    assert "{'option_strings'" not in text  # a % in a help string once broke argparse
    for title in ["model and data", "generation", "memory", "speed", "rewards",
                  "steps, validation, checkpoints, stopping and logging"]:  # fmt: skip
        assert f"\n{title}:\n" in text
    assert ("\nthe critic:\n" in text) == (script == "train_ppo.py")
    lines = text.splitlines()
    for f in dataclasses.fields(Args):
        shown = [line for line in lines if line.startswith(f"  --{f.name} ")]
        shown += [line for line in lines if line == f"  --{f.name}"]
        assert len(shown) == 1, f.name  # once, and without its --dashed-alias or --no_ twin
        help = cli.help_text(f)
        assert len(help) <= 170, (f.name, help)  # a line or two; docs/flags.md has the rest
        at = lines.index(shown[0])
        more = list(itertools.takewhile(lambda line: line.startswith(" " * 38), lines[at + 1 :]))
        rows = len(more) + bool(shown[0][38:].strip())  # a long name puts its help below it
        assert rows <= 2, (f.name, lines[at : at + 4])  # as --help shows it, at 100 columns
        assert help.count("default") <= 1 or "default:" not in help.split("(default:")[0], help
    assert "no_use_kl_loss" not in text and "--train-files" not in text


def test_a_flag_error_is_one_line_naming_the_closest_flags():
    with pytest.raises(SystemExit) as e:
        cli.parse(train_grpo.Args, ["--modle", "x"])
    assert "unknown flag --modle; did you mean --model?" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        cli.parse(train_grpo.Args, ["--critic_lr", "1e-5"])  # PPO's, not GRPO's
    assert "unknown flag --critic_lr" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        cli.parse(train_ppo.Args, ["--lr", "1e-6"])  # the flags it may mean: ending in _lr
    assert "unknown flag --lr; did you mean --actor_lr or --critic_lr?" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        cli.parse(train_grpo.Args, ["stray", "--rollout_n", "4"])
    assert "not a flag or a flag's value: stray" in str(e.value.code)
    # flags that make sense alone and not with the rest, before anything loads
    for argv, message in [
        (["--custom_reward_function_name", "f"], "needs --custom_reward_function_path"),
        (["--resume_mode", str(ROOT)], f"--resume_mode {ROOT} is not a checkpoint"),
        (["--train_batch_size", "0"], "--train_batch_size 0 must be >= 1"),  # its own range first
    ]:
        with pytest.raises(SystemExit, match=message):
            train_grpo.check_args(cli.parse(train_grpo.Args, argv), 1)
    for argv, message in [(["--modle", "x"], "did you mean --model?"),
                          (["--rollout_n", "x"], "invalid int value: 'x'")]:  # fmt: skip
        out = subprocess.run([sys.executable, "train_grpo.py", *argv], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert out.returncode != 0 and message in out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    # under torchrun: said once, not by every rank, and torchrun's summary names it for each rank;
    # a flag's name and its value, as this file's checks and argparse's own refuse them
    for argv, said in [
        (["--modle", "x"], "train_grpo.py: unknown flag --modle; did you mean --model?"),
        (["--rollout_n", "abc"], "train_grpo.py: argument --rollout_n/--rollout-n: invalid int"),
    ]:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                              "train_grpo.py", *argv], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        lines = out.stderr.splitlines()
        assert out.returncode != 0 and sum(line.startswith(said) for line in lines) == 1, out.stderr
        root_cause = out.stderr[out.stderr.index("Root Cause") :]
        assert f"traceback : {said}" in root_cause, out.stderr[-3000:]


# verl's GRPO tutorial for Qwen3-1.7B (its command line, as the tutorial gives it)
QWEN3_TUTORIAL = """
algorithm.adv_estimator=grpo data.train_files=/d/train.parquet data.val_files=/d/test.parquet
data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024
data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=Qwen/Qwen3-1.7B
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=80
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=20
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=20
actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=3
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=20
actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
trainer.critic_warmup=0 trainer.logger=['console'] trainer.project_name=verl_grpo_example_gsm8k
trainer.experiment_name=qwen3_1_7b_function_rm trainer.n_gpus_per_node=1 trainer.nnodes=1
trainer.save_freq=-1 trainer.test_freq=5 trainer.total_epochs=15
""".split()


def test_verls_command_line_is_taken_through_the_flags_table(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_grpo.py"])
    args = cli.parse(train_grpo.Args, QWEN3_TUTORIAL)
    assert (args.model, args.train_files) == ("Qwen/Qwen3-1.7B", "/d/train.parquet")
    assert args.train_batch_size == 1024
    assert args.rollout_n == 3 and args.ppo_mini_batch_size == 80 and args.actor_lr == 1e-6
    assert args.ppo_micro_batch_size_per_gpu == 20 and args.log_prob_micro_batch_size_per_gpu == 20
    assert args.enable_gradient_checkpointing and args.ref_param_offload
    assert not args.param_offload and args.filter_overlong_prompts
    assert args.logger == "console" and args.test_freq == 5 and args.save_freq == -1
    assert args.n_gpus_per_node == 1 and args.nnodes == 1
    left_out = "verl's trainer.critic_warmup=0: this script has no critic: left out"
    assert left_out in capsys.readouterr().err
    # the per-sequence micro-batches given this way count as given (verl's meaning kept)
    assert "ppo_micro_batch_size_per_gpu" in cli.given_flags()
    # what a script's Args says of verl's keys it has no flag for: the estimator it is, a section
    with pytest.raises(SystemExit, match="adv_estimator=gae: this script is GRPO"):
        cli.parse(train_grpo.Args, ["algorithm.adv_estimator=gae"])
    cli.parse(train_grpo.Args, ["algorithm.adv_estimator=grpo", "critic.optim.lr=1e-5"])
    left_out = "verl's critic.optim.lr=1e-5: this script has no critic: left out"
    assert left_out in capsys.readouterr().err
    # every key without a counterpart at once, not one a launch
    with pytest.raises(SystemExit) as e:
        cli.parse(train_grpo.Args, ["trainer.foo=3", "actor_rollout_ref.actor.optim.lrr=3"])
    both = "verl's trainer.foo: no counterpart here; verl's actor_rollout_ref.actor.optim.lrr: "
    assert both in str(e.value), e.value
    assert "(did you mean actor_rollout_ref.actor.optim.lr?)" in str(e.value)
    with pytest.raises(SystemExit) as e:  # a key of another kind is not "near" by its section
        cli.parse(train_grpo.Args, ["actor_rollout_ref.model.lora_rank=64"])
    assert "lora_rank: no counterpart here (docs/flags.md" in str(e.value), e.value
    # the device verl's tutorials name, and a key set to null (verl's default), are left out;
    # another device is refused
    cli.parse(train_grpo.Args, ["trainer.device=cuda", "data.val_batch_size=null"])
    err = capsys.readouterr().err
    assert "verl's trainer.device=cuda: the device is what torch finds" in err
    assert "verl's data.val_batch_size=null: no counterpart here, left out" in err
    with pytest.raises(SystemExit, match="trainer.device=npu: the device is what torch finds"):
        cli.parse(train_grpo.Args, ["trainer.device=npu"])
    # a choice with one answer here: left out when it asks for that, refused when not
    args = cli.parse(
        train_grpo.Args,
        ["actor_rollout_ref.actor.strategy=fsdp2", "reward_model.enable=False",
         "custom_reward_function.path=/r.py", "data.train_files=['/a.parquet','/b.parquet']"],
    )  # fmt: skip
    assert "verl's actor_rollout_ref.actor.strategy=fsdp2: training is FSDP2 here: left out" in (
        capsys.readouterr().err
    )
    assert args.custom_reward_function_path == "/r.py"  # verl's top-level key, and reward.'s
    assert args.train_files == "/a.parquet,/b.parquet"  # a list as the comma-separated flag
    with pytest.raises(SystemExit, match="reward_model.enable=True: rewards come from rules"):
        cli.parse(train_grpo.Args, ["reward_model.enable=True"])
    # Hydra's + prefix, null for the default, and verl's inverted enforce_eager
    hydra = ["+critic.optim.lr=2e-5", "data.val_files=null"]
    args = cli.parse(train_ppo.Args, [*hydra, "actor_rollout_ref.rollout.enforce_eager=False"])
    assert args.critic_lr == 2e-5 and args.val_files == train_ppo.Args().val_files
    assert args.rollout_compile is True
    # verl's critic warm-up of 3 updates the actor from step 3: two critic-only steps here
    assert cli.parse(train_ppo.Args, ["trainer.critic_warmup=3"]).critic_warmup == 2
    assert cli.parse(train_ppo.Args, ["trainer.critic_warmup=0"]).critic_warmup == 0


def test_a_hub_model_that_cannot_be_had_fails_in_seconds_naming_the_ways_out(tmp_path):
    """No network to the hub (an endpoint that refuses) and nothing cached; then HF_HUB_OFFLINE=1
    with nothing cached: a line naming --model and what to do, before any data or weights, in
    seconds rather than the hub's minute of retries."""
    import os
    import time

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE", None)
    for extra, message in [
        ({}, "--model Qwen/Qwen2.5-0.5B-Instruct: the hub (http://127.0.0.1:9) cannot be reached"),
        ({"HF_HUB_OFFLINE": "1"}, "and HF_HUB_OFFLINE=1 keeps the hub out"),
    ]:
        start = time.monotonic()
        out = subprocess.run([sys.executable, "train_grpo.py"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={**env, **extra})  # fmt: skip
        assert out.returncode == 1 and message in out.stderr, out.stderr[-2000:]
        assert "give a local folder (--model /path/to/model)" in out.stderr
        assert "Traceback" not in out.stderr and time.monotonic() - start < 30


def test_a_model_path_that_is_no_folder_is_named_with_its_flag(tmp_path):
    """A mistyped local folder is named as no folder, by the flag that gave it (the hub's
    validator raised a traceback at it); a second model, PPO's critic, by its own flag."""
    import models

    for path in (str(tmp_path / "nope"), "./nope", "~/nope", "a//b"):
        with pytest.raises(SystemExit, match=f" --critic_model {re.escape(path)}: no such folder"):
            models.check_source(path, "--critic_model")
    args = dataclasses.replace(train_ppo.Args(), critic_model="Org/critic")
    assert models.flag_of(args, "Org/critic") == "--critic_model"
    assert models.flag_of(args, args.model) == "--model"


def test_a_hub_model_the_hub_does_not_give_fails_in_seconds_naming_it(tmp_path):
    """The hub answers, but not with the model (a mirror without it, a private or gated one, a
    misspelled name): a line naming --model, the hub's answer and what to do, not the loaders'
    chained tracebacks after the planner has planned it from its table of known shapes."""
    import http.server
    import os
    import threading
    import time

    class NotFound(http.server.BaseHTTPRequestHandler):
        def answer(self):
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = answer

        def log_message(self, *args):
            pass

    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{hub.server_address[1]}"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint}
    env.pop("HF_HUB_OFFLINE", None)
    start = time.monotonic()
    try:
        argv = [sys.executable, "train_grpo.py", "--model", "Qwen/Qwen2.5-0.5B-Instruct"]
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    finally:
        hub.shutdown()
    message = (
        f"--model Qwen/Qwen2.5-0.5B-Instruct: the hub ({endpoint}) did not give its config.json"
    )
    assert out.returncode == 1 and message in out.stderr, out.stderr[-2000:]
    assert "Check the name; for a private or gated model" in out.stderr
    assert "Traceback" not in out.stderr and time.monotonic() - start < 30


def test_a_runs_folder_is_named_after_its_model_and_data(tmp_path, monkeypatch):
    assert flags.run_name("Qwen/Qwen2.5-0.5B-Instruct", "~/data/gsm8k/train.parquet") == (
        "qwen2.5-0.5b-instruct_gsm8k"
    )
    assert flags.run_name("/models/tiny/", "/d/prompts.parquet,/d/more.parquet") == "tiny_prompts"
    # a folder named for what it holds gives way to the one above: a run's export, a quick start's
    for folder in ("runs/a/hf_model", "quick/model", "quick/data", "mine/data"):
        (tmp_path / folder).mkdir(parents=True)
    export, train = tmp_path / "runs/a/hf_model", tmp_path / "mine/data/train.parquet"
    assert flags.run_name(str(export), str(train)) == "a_mine"
    quick = tmp_path / "quick"
    assert flags.run_name(str(quick / "model"), str(quick / "data/train.parquet")) == "quick_quick"
    # verl's export (global_step_N/actor/huggingface); not up to the home folder: ~/data is data
    (tmp_path / "v/global_step_9/actor/huggingface").mkdir(parents=True)
    verl_export = str(tmp_path / "v/global_step_9/actor/huggingface")
    monkeypatch.setenv("HOME", str(tmp_path / "quick"))
    assert flags.run_name(verl_export, str(quick / "data/train.parquet")) == "global_step_9_data"
