"""Job and drain states are enums whose members are their strings: records, JSON documents,
logs and tables read byte for byte as they did when the states were plain strings."""

from __future__ import annotations

import json

import pytest

from elasticd.cluster.drain_record import DrainPhase, DrainRecord, DrainState
from elasticd.cluster.jobspec import JobControl, JobState, NodeJobStatus
from elasticd.coordination import records


@pytest.mark.parametrize("member", [*JobState, *DrainState, *DrainPhase])
def test_a_member_is_its_string(member):
    assert member == member.value and hash(member) == hash(member.value)
    assert str(member) == f"{member}" == "%s" % member == member.value
    assert json.dumps([member], indent=2) == json.dumps([member.value], indent=2)


def test_records_encode_as_before_and_decode_to_members():
    st = NodeJobStatus("n1", JobState.RUNNING, "agent started")
    assert st.encode() == NodeJobStatus("n1", "running", "agent started").encode()
    assert NodeJobStatus.decode(st.encode()).state is JobState.RUNNING
    control = JobControl(JobState.STOPPED, 1.0, "elasticctl")
    assert JobControl.decode(control.encode()).desired is JobState.STOPPED
    rec = DrainRecord("n1", DrainState.DRAINING, phase=DrainPhase.REPLICAS)
    assert rec.encode() == DrainRecord("n1", "draining", phase="replicas").encode()
    back = DrainRecord.decode(rec.encode())
    assert back.state is DrainState.DRAINING and back.phase is DrainPhase.REPLICAS
    assert DrainRecord.decode(DrainRecord("n1").encode()).phase is DrainPhase.NONE


def test_an_unknown_state_is_still_refused():
    raw = NodeJobStatus("n1", "bogus").encode()
    with pytest.raises(records.CorruptRecord, match="unknown job state 'bogus'"):
        NodeJobStatus.decode(raw)
    with pytest.raises(records.CorruptRecord, match="unknown desired state 'idle'"):
        JobControl.decode(JobControl("idle", 1.0).encode())
    with pytest.raises(records.CorruptRecord, match="field 'state'"):
        NodeJobStatus.decode(records.encode(NodeJobStatus.KIND, {"node": "n1", "state": 3}))
    with pytest.raises(records.CorruptRecord, match="unknown drain phase 'rebooting'"):
        DrainRecord.decode(DrainRecord("n1", phase="rebooting").encode())
