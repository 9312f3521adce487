"""The agent's command line as torchrun's own parser reads it: the training script and its
arguments arrive unchanged, whatever they look like (a script argument that abbreviates one of
torchrun's options, such as ``--log`` or ``--node``, made plain torchrun refuse the launch)."""

from __future__ import annotations

import pytest
from torch.distributed.run import get_args_parser

from elasticd.agent.supervisor import AgentSupervisor
from elasticd.cluster.jobspec import JobSpec

ARGS = ["--log", "/tmp/x", "--node", "3", "--max", "--", "--nproc-per-node", "9", "-m"]


def spec(args):
    return JobSpec(name="j", nnodes_min=1, nnodes_max=2, nproc_per_node=2, script="/srv/train.py",
                   args=list(args), script_sha256="0" * 64, user="nobody", cwd="/srv")


def torchrun_sees(sup: AgentSupervisor):
    argv = sup.argv()
    # [python, -c, <safe module runner>, elasticd.agent.torchrun, torchrun's arguments...]
    assert argv[3] == "elasticd.agent.torchrun"
    return get_args_parser().parse_args(argv[4:])


@pytest.mark.parametrize("warm", [False, True])
def test_script_arguments_reach_the_script_unchanged(warm):
    sup = AgentSupervisor(spec(ARGS), "n1", "tag", "127.0.0.1:2379", "/elasticd", "/tmp/logs",
                          warm=warm)
    parsed = torchrun_sees(sup)
    assert parsed.nproc_per_node == "2"
    if warm:
        assert parsed.module and parsed.training_script == "elasticd.agent.warm_start"
        assert parsed.training_script_args == ["/srv/train.py", *ARGS]
    else:
        assert not parsed.module and parsed.training_script == "/srv/train.py"
        assert parsed.training_script_args == ARGS


def test_without_the_separator_torchrun_refuses_such_arguments():
    """What the separator is for: torchrun's parser alone takes --log for its own option."""
    with pytest.raises(SystemExit):
        get_args_parser().parse_args(["--nproc-per-node", "2", "/srv/train.py", "--log", "x"])


def test_an_in_process_jobs_agent_polls_often_and_computes_its_workers_ranks():
    """Issue 31: the agent learns that a member is gone when its monitor asks (every
    monitor interval), and torch's rank assignment through the store costs two rounds of
    etcd requests per re-formation; every node of a job runs the same workers, so torch's
    identical-workers path gives the same ranks without them. A job not in the mode keeps
    both as they were."""
    import dataclasses
    import pwd

    user = pwd.getpwuid(0).pw_name
    plain = AgentSupervisor(dataclasses.replace(spec(ARGS), user=user), "n1", "tag",
                            "127.0.0.1:2379", "/elasticd", "/tmp/logs")
    inproc = AgentSupervisor(dataclasses.replace(spec(ARGS), user=user, in_process=True), "n1",
                             "tag", "127.0.0.1:2379", "/elasticd", "/tmp/logs")
    assert torchrun_sees(plain).monitor_interval == 0.1
    assert torchrun_sees(inproc).monitor_interval == 0.02
    assert "TORCH_ELASTIC_WORKER_IDENTICAL" not in plain.env()
    assert inproc.env()["TORCH_ELASTIC_WORKER_IDENTICAL"] == "1"
