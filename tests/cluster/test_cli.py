"""The `hyparflow` command: run (dry run, errors, exit code), info, slurm rendering."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from hyparflow import cli
from hyparflow.cluster import dialect, launch, slurm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "digits_resnet.py")
MPIEXEC = launch.find_mpiexec()
OPENMPI = MPIEXEC is not None and dialect.of_mpiexec(MPIEXEC) == dialect.OPENMPI
HOSTS_FLAG = "--host" if OPENMPI else "-hosts"   # Open MPI's word, or MPICH's (hydra)


@pytest.fixture
def clean_env(monkeypatch):
    """No Slurm job, no HYPARFLOW_* settings inherited from the caller's shell."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "HYPARFLOW_NUM_")) or name in (
                "HYPARFLOW_THREADS", "HYPARFLOW_THREADS_PER_RANK", "OMP_NUM_THREADS"):
            monkeypatch.delenv(name)
    return monkeypatch


def dry_run(capsys, *argv):
    code = cli.main(["run", "--dry-run", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    exports = dict(re.findall(r"^export (\w+)=(.*)$", out, re.M))
    command = out.strip().splitlines()[-1]
    return exports, command, out


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH")
def test_run_dry_run_local(clean_env, capsys):
    exports, command, out = dry_run(capsys, "-n", "4", "--stages", "2", "--microbatches", "3",
                                    EXAMPLE, "--epochs", "2", "--stages", "2")
    assert "# launcher: mpiexec" in out
    assert exports["HYPARFLOW_NUM_STAGES"] == "2"
    assert exports["HYPARFLOW_NUM_MICROBATCHES"] == "3"
    # Replicas are derived where S is known (the script may pass its own num_stages).
    assert "HYPARFLOW_NUM_REPLICAS" not in exports and "HYPARFLOW_NUM_TENSOR" not in exports
    assert "# layout: 4 ranks; stages 2, microbatches 3" in out
    assert exports["HYPARFLOW_THREADS_PER_RANK"] == str(max(1, launch.usable_cores() // 4))
    assert exports["PYTHONUNBUFFERED"] == "1"
    assert exports["TF_CPP_MIN_LOG_LEVEL"] == "2"
    # The script's own arguments, even those named like ours, are passed through.
    assert command.endswith(f"-n 4 {sys.executable} {EXAMPLE} --epochs 2 --stages 2")
    assert command.split()[0] == MPIEXEC


def test_run_dry_run_threads_and_defaults(clean_env, capsys):
    exports, _, out = dry_run(capsys, "-n", "3", "--threads", "5", EXAMPLE)
    assert exports["HYPARFLOW_THREADS_PER_RANK"] == "5"
    # Nothing asked for, nothing imposed: the script's hf.fit arguments decide.
    assert not [name for name in exports if name.startswith("HYPARFLOW_NUM_")], exports
    assert "as the script's hf.fit says (without arguments: 1 stage x 3 replicas)" in out
    clean_env.setenv("HYPARFLOW_NUM_STAGES", "3")  # the shell's setting is checked, inherited
    exports, _, out = dry_run(capsys, "-n", "6", EXAMPLE)
    assert not [name for name in exports if name.startswith("HYPARFLOW_NUM_")], exports
    assert "# layout: 6 ranks; stages 3" in out
    assert cli.main(["run", "--dry-run", "-n", "4", EXAMPLE]) == 2
    assert "4 ranks cannot be split into pipelines of 3 stages" in capsys.readouterr().err
    clean_env.delenv("HYPARFLOW_NUM_STAGES")
    # --tensor: each stage takes T ranks, the replicas what is left (derived, not exported).
    exports, _, _ = dry_run(capsys, "-n", "12", "--stages", "2", "--tensor", "2", EXAMPLE)
    assert (exports["HYPARFLOW_NUM_STAGES"], exports["HYPARFLOW_NUM_TENSOR"]) == ("2", "2")
    assert "HYPARFLOW_NUM_REPLICAS" not in exports
    # --replicas alone: the script chooses its stages; only divisibility is checked.
    exports, _, _ = dry_run(capsys, "-n", "4", "--replicas", "2", EXAMPLE)
    assert exports["HYPARFLOW_NUM_REPLICAS"] == "2" and "HYPARFLOW_NUM_STAGES" not in exports
    assert cli.main(["run", "--dry-run", "-n", "5", "--replicas", "2", EXAMPLE]) == 2
    assert "cannot be split into --replicas 2" in capsys.readouterr().err


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH")
def test_run_takes_a_plans_ranks_and_threads_and_fit_its_layout(clean_env, capsys, tmp_path):
    from hyparflow.layout import resolve

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({
        "format": "hyparflow-strategy", "version": 1,
        "mesh": {"axes": ["stage", "tensor", "replica"], "shape": [2, 1, 3]},
        "num_microbatches": 4, "schedule": "1f1b", "threads_per_rank": 1,
        "stages": [{"recompute": False}, {"recompute": False}],
        "layers": [{"name": "a", "stage": 0}, {"name": "b", "stage": 1}]}))
    exports, command, out = dry_run(capsys, "--plan", str(plan), EXAMPLE)
    assert exports["HYPARFLOW_PLAN"] == str(plan)
    assert exports["HYPARFLOW_THREADS_PER_RANK"] == "1"
    assert f"-n 6 {sys.executable} {EXAMPLE}" in command
    # -n and --threads-per-rank given win over the plan's.
    exports, command, _ = dry_run(capsys, "--plan", str(plan), "-n", "12", "--threads", "2",
                                  EXAMPLE)
    assert exports["HYPARFLOW_THREADS_PER_RANK"] == "2" and "-n 12 " in command
    # fit's layout, where the script passes no plan=: the exported plan's.
    layout = resolve(6, environ=exports)
    assert (layout.num_stages, layout.num_replicas, layout.num_microbatches) == (2, 3, 4)
    with pytest.raises(ValueError, match=r"num_microbatches=2 \(the argument\) contradicts "
                                         r"the plan .*\$HYPARFLOW_PLAN"):
        resolve(6, num_microbatches=2, environ=exports)
    assert cli.main(["run", "--dry-run", "--plan", str(tmp_path / "none.json"), EXAMPLE]) == 2
    assert "--plan: Cannot read plan" in capsys.readouterr().err


def test_run_dry_run_inside_slurm_uses_srun(clean_env, capsys, tmp_path):
    fake = tmp_path / "srun"
    # `srun --mpi=list` names PMIx, which Open MPI's ranks start through.
    fake.write_text("#!/bin/sh\necho 'MPI plugin types are...'; echo pmi2; echo pmix\n")
    fake.chmod(0o755)
    clean_env.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    clean_env.setenv("SLURM_JOB_ID", "1234")
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("SLURM_CPUS_PER_TASK", "3")
    exports, command, out = dry_run(capsys, "--stages", "2", EXAMPLE)   # -n from SLURM_NTASKS
    assert "# launcher: srun (inside Slurm job 1234)" in out
    mpi = "pmix" if dialect.library() == dialect.OPENMPI else "pmi2"
    assert command.startswith(f"{fake} --mpi={mpi} -n 4 ")
    assert exports["HYPARFLOW_THREADS_PER_RANK"] == "3"
    assert exports["HYPARFLOW_NUM_STAGES"] == "2" and "HYPARFLOW_NUM_REPLICAS" not in exports
    exports, command, _ = dry_run(capsys, "-n", "2", "--launcher", "mpiexec", EXAMPLE)
    assert command.split()[0] == MPIEXEC and " -n 2 " in command


@pytest.mark.parametrize("argv,message", [
    (["-n", "3", "--stages", "2"], "must be a multiple of --stages"),
    (["-n", "4", "--stages", "2", "--replicas", "3"], "--stages 2 x --replicas 3 = 6"),
    (["-n", "0"], "positive integer"),
    (["-n", "6", "--stages", "2", "--tensor", "2"], "multiple of --stages x --tensor (e.g. -n 4 or -n 8)"),
    ([], "give the number of ranks"),
])
def test_run_bad_counts(clean_env, capsys, argv, message):
    assert cli.main(["run", "--dry-run", *argv, EXAMPLE]) == 2
    assert message in capsys.readouterr().err


def test_run_missing_script(clean_env, capsys):
    assert cli.main(["run", "-n", "2", "no/such/train.py"]) == 2
    assert "script not found: 'no/such/train.py'" in capsys.readouterr().err


@pytest.mark.mpiexec
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH")
@pytest.mark.timeout(120)
def test_run_propagates_the_exit_code(tmp_path):
    script = tmp_path / "exit3.py"
    script.write_text("import os, sys\n"
                      "from mpi4py import MPI\n"
                      "assert MPI.COMM_WORLD.Get_size() == 2\n"
                      "assert 'HYPARFLOW_NUM_REPLICAS' not in os.environ\n"
                      "sys.exit(3 if MPI.COMM_WORLD.Get_rank() == 0 else 0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "hyparflow", "run", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=100, env=env)
    assert out.returncode == 3, out.stdout + out.stderr


def _subcommands():
    parser = cli.build_parser()
    return sorted(next(a for a in parser._actions if a.dest == "command").choices)


def test_every_subcommand_is_checked_here():
    # data-service: tests/readers/test_service.py (its processes start and stop).
    assert _subcommands() == ["data-service", "export", "info", "plan", "run", "slurm",
                              "strategy", "trace"]


@pytest.mark.parametrize("command", _subcommands())
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_subcommand_has_help(capsys, command, flag):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, flag])
    out, err = capsys.readouterr()
    assert exit_.value.code == 0, err
    assert out.startswith(f"usage: hyparflow {command}"), out + err
    assert "error" not in err, err


def test_info_has_the_fields(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for field in ("hyparflow:", "python:", "MPI library:", "mpi4py:", "tensorflow:", "keras:",
                  "numpy:", "mpiexec:", "cores:", "ranks per node:", "threads per rank:",
                  "slurm", "in Slurm allocation:"):
        assert re.search(rf"^{re.escape(field)}", out, re.M), f"no {field!r} in\n{out}"
    import keras
    import tensorflow as tf
    assert f"tensorflow:           {tf.__version__}" in out
    assert f"keras:                {keras.__version__}" in out
    # The MPI named as the family it is, and the launcher found is the same MPI's.
    library = re.search(r"^MPI library: +(.*)$", out, re.M).group(1)
    family = dialect.of_text(library)
    assert family != dialect.UNKNOWN, library
    if family == dialect.OPENMPI:
        assert re.search(r"^MPI btl: +.*\bself\b", out, re.M), out
    else:
        assert re.search(r"^MPI device: +\S", out, re.M), out
    if MPIEXEC is not None:
        assert f"mpiexec:              {MPIEXEC} ({dialect.NAMES[family]}, mpi4py's)" in out


@pytest.mark.timeout(120)
def test_info_command_is_quiet():
    out = subprocess.run([sys.executable, "-m", "hyparflow", "info"], capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "MPI library:" in out.stdout
    assert out.stderr == "", out.stderr


def test_launch_and_slurm_modules_do_not_import_tensorflow():
    code = (
        "import importlib.util, os, sys, types\n"
        "spec = importlib.util.find_spec('hyparflow')\n"
        "pkg = types.ModuleType('hyparflow'); pkg.__path__ = [os.path.dirname(spec.origin)]\n"
        "sys.modules['hyparflow'] = pkg\n"
        "import hyparflow.cluster.launch, hyparflow.cluster.slurm\n"
        "print(sorted(m for m in ('tensorflow', 'keras', 'mpi4py') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --- hyparflow slurm ---------------------------------------------------------------------

def render(capsys, *argv):
    code = cli.main(["slurm", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def sbatch_lines(text):
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def assert_common(text, exports):
    assert text.startswith("#!/bin/bash\n")
    assert f"source {sys.prefix}/bin/activate" in text or f"export PATH={os.path.dirname(sys.executable)}" in text
    assert "#SBATCH --signal=B:USR1@120" in text
    assert "#SBATCH --requeue" in text
    # USR1 before the limit goes on to the ranks; a checkpointed stop (exit 75) is requeued.
    assert "trap on_time_limit USR1" in text and 'kill -USR1 "$PID"' in text
    assert 'if [ "$STATUS" -eq "$PREEMPTED" ]; then' in text and "PREEMPTED=75" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    # After USR1, srun's SIGTERM to ranks still exiting (one exited 75 first) is requeued too.
    assert 'if [ -n "$STOPPING" ] && [ "$STATUS" -eq 143 ]; then' in text and "STOPPING=1" in text
    assert ('export OMP_NUM_THREADS="$SLURM_CPUS_PER_TASK" '
            'HYPARFLOW_THREADS="$SLURM_CPUS_PER_TASK"') in text
    # Only the counts given are exported: a script's own num_stages must not meet a
    # replica count derived from another S.
    assert exports in text.splitlines()
    assert "HYPARFLOW_NUM_REPLICAS" not in text
    assert not re.search(r"\$\{[a-z_]+\}", text), "a placeholder was left"
    # The shell accepts it.
    check = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_slurm_single(capsys):
    text, _ = render(capsys, "--tasks-per-node", "4", "--stages", "2", "--microbatches", "4",
                     "--time", "00:30:00", "--partition", "debug", "--cpus-per-task", "2",
                     "--job-name", "digits", EXAMPLE, "--epochs", "2")
    lines = sbatch_lines(text)
    for expected in ("#SBATCH --job-name=digits", "#SBATCH --nodes=1", "#SBATCH --ntasks=4",
                     "#SBATCH --time=00:30:00", "#SBATCH --output=digits-%j.out",
                     "#SBATCH --partition=debug", "#SBATCH --cpus-per-task=2",
                     f"#SBATCH --chdir={os.getcwd()}"):
        assert expected in lines, (expected, lines)
    assert not any("--ntasks-per-node" in line for line in lines)
    assert_common(text, "export HYPARFLOW_NUM_STAGES=2 HYPARFLOW_NUM_MICROBATCHES=4")
    assert text.splitlines()[1] == "# hyparflow on one node: 4 ranks = 2 stages x 2 replicas, 4 microbatches."
    launch_line = [line for line in text.splitlines() if line.startswith("srun ")]
    assert launch_line == [f"srun --mpi=pmi2 --kill-on-bad-exit=1 --distribution=block:block "
                           f"python {EXAMPLE} --epochs 2 &"]


def test_slurm_tensor(capsys):
    """--tensor, as `hyparflow run --tensor`: exported, in the layout line, and a node's
    tasks checked against stages x tensor ranks."""
    text, _ = render(capsys, "--tasks-per-node", "4", "--stages", "2", "--tensor", "2", EXAMPLE)
    assert_common(text, "export HYPARFLOW_NUM_STAGES=2 HYPARFLOW_NUM_TENSOR=2")
    assert text.splitlines()[1] == ("# hyparflow on one node: 4 ranks = 2 stages x 2 tensor "
                                    "ranks x 1 replicas.")
    _, err = render(capsys, "--nodes", "2", "--tasks-per-node", "3", "--stages", "1",
                    "--tensor", "2", EXAMPLE)
    assert "--tasks-per-node 3 is not a multiple of --stages 1 x --tensor 2" in err
    assert cli.main(["slurm", "--tasks-per-node", "3", "--tensor", "2", EXAMPLE]) == 2
    assert "cannot be split" in capsys.readouterr().err


def test_plan_help_says_what_it_measures(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "rank the plans by a cost model with an alpha-beta network." in out
    assert "minutes for a small CNN on 2 cores." in out and "--quick keeps only" in out
    assert "each ranks x threads per rank the cores allow" in out
    for flag, words in (("--function FUNCTION", "returns the compiled model"),
                        ("--ranks N|auto", "threads per rank, each candidate measured"),
                        ("--length N", "the sequence length you train at"),
                        ("--top TOP", "how many of the ranked plans"),
                        ("--quick", "no contention sweep")):
        assert re.search(re.escape(flag) + r" +" + r".*" + re.escape(words), out), flag


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_slurm_hybrid(capsys, launcher):
    text, _ = render(capsys, "--nodes", "3", "--tasks-per-node", "4", "--stages", "2",
                     "--launcher", launcher, "--overcommit", "--sbatch-option=--qos=long",
                     EXAMPLE, "--save", "my model.keras")
    lines = sbatch_lines(text)
    for expected in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=4",
                     "#SBATCH --distribution=block:block", "#SBATCH --overcommit",
                     "#SBATCH --qos=long", "#SBATCH --time=01:00:00"):
        assert expected in lines, (expected, lines)
    assert "rank = replica * 2 + stage" in text
    assert "gradient allreduce" in text
    assert_common(text, "export HYPARFLOW_NUM_STAGES=2")
    command = f"python {EXAMPLE} --save 'my model.keras' &"
    launch_lines = [line for line in text.splitlines() if line.endswith(" &")]
    if launcher == "srun":
        assert launch_lines == [f"srun --mpi=pmi2 --kill-on-bad-exit=1 "
                                f"--distribution=block:block {command}"]
    else:
        assert launch_lines == [f'mpiexec -n "$SLURM_NTASKS" {command}']


def test_slurm_array(capsys):
    text, _ = render(capsys, "--array", "0-7%2", "--tasks-per-node", "2", "--time", "2:00:00",
                     EXAMPLE, "--seed={task}")
    lines = sbatch_lines(text)
    assert "#SBATCH --array=0-7%2" in lines
    assert f"#SBATCH --output={os.path.splitext(os.path.basename(EXAMPLE))[0]}-%A_%a.out" in lines
    assert_common(text, "# (none given: the script's hf.fit arguments, else its defaults)")
    assert "each on 1 node(s): 2 ranks; stages and replicas as the script's hf.fit says." in text
    assert f'python {EXAMPLE} --seed="$SLURM_ARRAY_TASK_ID" &' in text
    # Without {task}, the index is the last argument.
    text, _ = render(capsys, "--array", "1,3", EXAMPLE, "--epochs", "2")
    assert f'python {EXAMPLE} --epochs 2 "$SLURM_ARRAY_TASK_ID" &' in text


def test_slurm_output_file_and_warnings(capsys, tmp_path):
    path = tmp_path / "job.sbatch"
    code = cli.main(["slurm", "--nodes", "2", "--tasks-per-node", "3", "--stages", "2",
                     "--output", str(path), EXAMPLE])
    out, err = capsys.readouterr()
    assert code == 0 and out == ""
    assert "is not a multiple of --stages 2" in err
    text = path.read_text()
    assert "#SBATCH --nodes=2" in text and os.access(path, os.X_OK)


@pytest.mark.parametrize("argv,message", [
    (["--nodes", "2", "--tasks-per-node", "3", "--stages", "4"], "must be a multiple of --stages"),
    (["--nodes", "2", "--template", "single"], "the single template is for one node"),
    (["--template", "array"], "needs --array"),
    (["--array", "0-3", "--template", "hybrid"], "--array needs the array template"),
    (["--time", "soon"], "is not a Slurm time limit"),
    (["--template", "nonesuch"], "unknown template 'nonesuch'"),
])
def test_slurm_bad_options(capsys, argv, message):
    assert cli.main(["slurm", *argv, EXAMPLE]) == 2
    assert message in capsys.readouterr().err


def test_slurm_time_limits_and_signal():
    assert slurm.parse_time("90") == 5400
    assert slurm.parse_time("10:30") == 630
    assert slurm.parse_time("01:00:00") == 3600
    assert slurm.parse_time("1-12") == 86400 + 12 * 3600
    assert slurm.parse_time("2-00:30:15") == 2 * 86400 + 30 * 60 + 15
    assert slurm.signal_lead(3600) == 120
    assert slurm.signal_lead(60) == 12   # a short limit must not be signalled at once


def test_slurm_custom_template_placeholders(capsys, tmp_path):
    good = tmp_path / "mine.sbatch"
    good.write_text("#!/bin/bash\n#SBATCH --ntasks=${ntasks}\necho $HOME ${HOME:-x}\n${launch}\n")
    text, _ = render(capsys, "--template", str(good), "--tasks-per-node", "2", EXAMPLE)
    assert "#SBATCH --ntasks=2\necho $HOME ${HOME:-x}\nsrun --mpi=pmi2" in text
    bad = tmp_path / "bad.sbatch"
    bad.write_text("#!/bin/bash\n#SBATCH --ntasks=${ntask}\n")
    assert cli.main(["slurm", "--template", str(bad), EXAMPLE]) == 2
    assert "unknown placeholders: ntask" in capsys.readouterr().err


def test_every_template_is_in_the_repository():
    for name in slurm.TEMPLATES:
        assert slurm.template_path(name).is_file()


def test_the_node_template_lets_hyparflow_run_plan_the_node(clean_env, capsys):
    """`--template node`: the whole node, no task count (so that `hyparflow run` plans
    it: tests/cluster/test_run_plans.py), launched by `hyparflow run` without -n."""
    text, _ = render(capsys, "--template", "node", EXAMPLE, "--epochs", "2")
    assert "#SBATCH --exclusive" in text and "--ntasks" not in text.split("srun")[0]
    launch_line = next(line for line in text.splitlines() if line.endswith(" &"))
    assert launch_line.split()[1:4] == ["-m", "hyparflow", "run"]
    assert launch_line.endswith(f"{EXAMPLE} --epochs 2 &") and " -n " not in launch_line
    assert cli.main(["slurm", "--template", "node", "--stages", "2", EXAMPLE]) == 2
    assert "plans one node's ranks x threads" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_cluster_script_usage():
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm-cluster.sh")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "usage" in out.stderr


# --- hyparflow export ----------------------------------------------------------------------

def test_export_writes_the_newest_checkpoint(tmp_path, capsys):
    import keras
    import numpy as np

    import models
    from hyparflow.engine.local import run_ranks

    x, y = models.mlp_data(32)
    directory = str(tmp_path / "ckpt")

    def body(comm):
        model = models.mlp()
        import hyparflow as hf
        hf.fit(model, x, y, batch_size=8, epochs=1, num_stages=2, comm=comm, verbose=0,
               checkpoint_dir=directory)
        return model.get_weights()

    trained = run_ranks(2, body, timeout=120)[0]
    output = tmp_path / "model.keras"
    assert cli.main(["export", directory, "-o", str(output)]) == 0
    assert "wrote" in capsys.readouterr().err
    exported = keras.saving.load_model(output)
    assert all(np.array_equal(a, b) for a, b in zip(exported.get_weights(), trained))
    assert cli.main(["export", str(tmp_path / "nowhere"), "-o", str(output)]) == 2
    assert "No such checkpoint directory" in capsys.readouterr().err


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside python or on PATH")
def test_run_hosts_places_pipelines_within_hosts(clean_env, capsys, tmp_path):
    exports, command, out = dry_run(capsys, "--hosts", "node1:2,node2:2", "--stages", "2",
                                    EXAMPLE)
    assert "# launcher: mpiexec (--hosts/--hostfile)" in out
    assert command.startswith(f"{MPIEXEC} {HOSTS_FLAG} node1:2,node2:2 ") and " -n 4 " in command
    assert re.findall(r"^# (rank \d+: .*)$", out, re.M) == [
        "rank 0: node1 (stage 0, replica 0)", "rank 1: node1 (stage 1, replica 0)",
        "rank 2: node2 (stage 0, replica 1)", "rank 3: node2 (stage 1, replica 1)"]
    assert "spans hosts" not in out
    # Threads are each host's business (its cores over its ranks), not this machine's.
    assert "HYPARFLOW_THREADS_PER_RANK" not in exports
    # Only what was given is exported: the replicas are derived where fit knows S.
    assert exports["HYPARFLOW_NUM_STAGES"] == "2" and "HYPARFLOW_NUM_REPLICAS" not in exports
    # A hostfile, -n below the slots, and a pipeline that crosses hosts is pointed out.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nnode1 slots=3\n\nnode2:3  # comment\n")
    _, command, out = dry_run(capsys, "--hostfile", str(hostfile), "-n", "4", "--stages", "2",
                              "--tensor", "1", EXAMPLE)
    assert f"{MPIEXEC} {HOSTS_FLAG} node1:3,node2:3 " in command and " -n 4 " in command
    assert "# rank 3: node2 (stage 1, replica 1)" in out
    assert "note: replica 1's pipeline spans hosts node1, node2" in out


def _fake(path, text):
    """An executable that prints `text` whatever it is asked."""
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\n")
    path.chmod(0o755)
    return str(path)


HYDRA = "HYDRA build details:\n    Version: 4.3.0"
ORTE = "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/"


def test_the_launcher_speaks_its_mpis_dialect(tmp_path):
    """mpi4py built with Open MPI: its mpiexec is chosen over MPICH's beside Python, and
    spoken to in its words: --host, -x for what the ranks need on other hosts, no
    binding, --oversubscribe on this machine. Built with MPICH: hydra's -hosts, nothing
    else. A launcher of another MPI than mpi4py's is refused (each rank would run alone);
    a missing one says what to do for that MPI."""
    python = _fake(tmp_path / "venv" / "python", "Open MPI v4.1.4, package: Debian OpenMPI")
    _fake(tmp_path / "venv" / "mpiexec", HYDRA)
    ompi = _fake(tmp_path / "ompi" / "mpiexec", ORTE)
    environ = {"PATH": str(tmp_path / "ompi"), "HYPARFLOW_TIMEOUT": "60",
               "PYTHONPATH": "/src", "HOME": "/root"}
    line = launch.command_line(EXAMPLE, ranks=4, stages=2, python=python, environ=environ,
                               hosts=[("h1", 2), ("h2", 2)])
    assert line.argv[:5] == [ompi, "--host", "h1:2,h2:2", "--map-by", "slot"]
    forwarded = [line.argv[k + 1] for k, word in enumerate(line.argv) if word == "-x"]
    assert {"HYPARFLOW_NUM_STAGES", "HYPARFLOW_TIMEOUT", "PYTHONPATH", "PATH",
            "PYTHONUNBUFFERED"} <= set(forwarded) and "HOME" not in forwarded
    assert line.argv[-6:] == ["--bind-to", "none", "-n", "4", python, EXAMPLE]
    local = launch.command_line(EXAMPLE, ranks=4, python=python, environ=environ)
    assert local.argv == [ompi, "--oversubscribe", "--bind-to", "none", "-n", "4", python,
                          EXAMPLE]
    # MPICH's mpi4py: the hydra beside Python, which forwards the whole environment.
    mpich = _fake(tmp_path / "mpich" / "python", "MPICH Version: 4.3.0")
    hydra = _fake(tmp_path / "mpich" / "mpiexec", HYDRA)
    line = launch.command_line(EXAMPLE, ranks=4, python=mpich, environ=environ,
                               hosts=[("h1", 2), ("h2", 2)])
    assert line.argv == [hydra, "-hosts", "h1:2,h2:2", "-n", "4", mpich, EXAMPLE]
    # Open MPI's mpi4py with only hydra to start it.
    with pytest.raises(launch.LaunchError, match="is MPICH's but mpi4py is built with Open MPI"):
        launch.command_line(EXAMPLE, ranks=2, python=python, environ={"PATH": str(tmp_path)})
    lone = _fake(tmp_path / "lone" / "python", "Open MPI v4.1.4")
    with pytest.raises(launch.LaunchError, match="built with Open MPI: put its bin directory"):
        launch.command_line(EXAMPLE, ranks=2, python=lone, environ={"PATH": str(tmp_path)})


def test_restart_probes_a_host_in_its_launchers_words(tmp_path):
    """--restarts probes each host with a one-rank run of `true`: hydra's -hosts, or
    Open MPI's --host (the fake launchers write how they were called)."""
    from hyparflow.cluster import restart

    for version, flag in ((HYDRA, "-hosts"), (ORTE, "--host")):
        fake = tmp_path / f"mpiexec-{flag}"
        fake.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then cat <<'EOF'\n{version}\n"
                        f"EOF\nexit 0; fi\necho \"$@\" >> {tmp_path}/calls; exit 0\n")
        fake.chmod(0o755)
        assert restart.probe(["h1"], str(fake), seconds=20) == {"h1": True}
        assert (tmp_path / "calls").read_text().splitlines()[-1].startswith(f"{flag} h1:1 ")


@pytest.mark.parametrize("argv,message", [
    (["--hosts", "a:0"], "the slots of 'a' must be a positive integer. Received: '0'"),
    (["--hosts", "a:2,b,a:1"], "host 'a' is listed twice; give it once with all its slots (a:3)"),
    (["--hosts", "a b"], "cannot read 'a b'"),
    (["--hosts", "a:2", "-n", "3"], "3 ranks but the hosts have 2 slots (a:2)"),
    (["--hosts", "a:2", "--launcher", "srun"], "--hosts/--hostfile start the ranks with mpiexec"),
    (["--hostfile", "/nonexistent/hosts"], "cannot read the hostfile '/nonexistent/hosts'"),
])
def test_run_hosts_errors(clean_env, capsys, argv, message):
    code = cli.main(["run", "--dry-run", *argv, EXAMPLE])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err


@pytest.mark.timeout(120)
def test_the_command_entry_point_says_it_is_the_command():
    """The console script's module (hyparflow_command) loads first and tells the package
    not to start TensorFlow; any other importer of hyparflow gets TensorFlow started."""
    probe = "print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    command = subprocess.run(
        [sys.executable, "-c", f"import sys, hyparflow_command, hyparflow; {probe}"],
        capture_output=True, text=True, timeout=100)
    assert command.returncode == 0, command.stderr
    assert command.stdout.split() == ["False", "False"]
    script = subprocess.run([sys.executable, "-c", f"import sys, hyparflow; {probe}"],
                            capture_output=True, text=True, timeout=100)
    assert script.returncode == 0, script.stderr
    assert script.stdout.split() == ["True", "True"]


@pytest.mark.timeout(120)
def test_python_m_hyparflow_is_the_command_without_tensorflow():
    """`python -m hyparflow run ...` starts no TensorFlow either (seconds of a core
    before any rank starts); a script that is passed `-m hyparflow` is not the command."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "hyparflow", "run", "--help"],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")}
    assert "hyparflow.cli" in imported, out.stderr[-2000:]
    assert not {"tensorflow", "keras"} & imported
    from hyparflow import _env
    assert _env.run_as_module(["python", "-u", "-X", "importtime", "-m", "hyparflow", "run"])
    assert not _env.run_as_module(["python", "train.py", "-m", "hyparflow"])
    assert not _env.run_as_module(["python", "-c", "pass", "-m", "hyparflow"])
    assert not _env.run_as_module(["python", "-m", "pytest", "-m", "hyparflow"])


def test_slurm_sweep_is_one_job(capsys, tmp_path):
    """--sweep: one job of the sweep template, the configs file exported (absolute), the
    members' share per group in the layout line; --replicas exported for hf.sweep."""
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps([{"learning_rate": 10.0 ** -k} for k in range(1, 9)]))
    text, err = render(capsys, "--sweep", str(configs), "--nodes", "2", "--tasks-per-node", "2",
                       "--replicas", "2", EXAMPLE, "--epochs", "3")
    lines = sbatch_lines(text)
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2"):
        assert expected in lines, (expected, lines)
    assert not any("--array" in line for line in lines)
    assert text.splitlines()[1] == ("# hyparflow sweep on 2 node(s) x 2 tasks: 8 members over 4 "
                                    "ranks = 2 groups x 2 replica(s), about 4 members per group.")
    assert f"export HYPARFLOW_SWEEP_CONFIGS={configs} HYPARFLOW_NUM_REPLICAS=2" in text.splitlines()
    assert f"python {EXAMPLE} --epochs 3 &" in text
    assert not re.search(r"\$\{[a-z_]+\}", text), "a placeholder was left"
    check = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr
    assert err == ""
    # Uneven shares are said; more groups than members, or stages, are refused.
    _, err = render(capsys, "--sweep", str(configs), "--tasks-per-node", "3", EXAMPLE)
    assert "8 members over 3 groups: some groups train 3 members, others 2." in err
    configs.write_text(json.dumps([{"a": 1}, {"a": 2}]))
    assert cli.main(["slurm", "--sweep", str(configs), "--tasks-per-node", "4", EXAMPLE]) == 2
    assert "4 ranks with --replicas 1 make 4 groups for 2 members" in capsys.readouterr().err
    assert cli.main(["slurm", "--sweep", str(configs), "--stages", "2", EXAMPLE]) == 2
    assert "--sweep runs one job of hf.sweep: it takes no --array, --stages" in \
        capsys.readouterr().err
    configs.write_text("{}")
    assert cli.main(["slurm", "--sweep", str(configs), EXAMPLE]) == 2
    assert "must hold a non-empty JSON list of objects" in capsys.readouterr().err
