"""An action asked for at a step runs at that step's safe point or not at all, and the CLI asks every rank again
when one had passed it: a checkpoint of sharded ranks, or an lr change, never lands at different steps on
different ranks (CI on stop 34: the FSDP2 ranks saved their shards at steps 21 and 22, because the second rank's
request came after its step 21, and the queue then ran it at the next safe point)."""

from __future__ import annotations

import pytest

from probe import EndpointError


@pytest.fixture
def queue(monkeypatch, tmp_path):
    from probe.actions import queue
    from probe.training import boundary

    monkeypatch.setenv("PROBE_RUNTIME_DIR", str(tmp_path))  # the audit log
    monkeypatch.setattr(boundary, "last_step", 40)
    yield queue
    with queue._lock:
        queue._pending.clear()
    boundary.remove(queue._at_step)


def submit(queue, at_step, ran):
    return queue.submit(
        "eval", lambda ctx: ran.append(ctx.step) or {}, args={}, client={"transport": "test"}, at_step=at_step
    )


def test_a_step_already_passed_fails_at_once_as_missed_and_never_runs(queue, tmp_path):
    import json

    from probe.training import boundary

    ran = []
    a = submit(queue, 40, ran)
    assert (a.state, a.missed) == ("failed", True)
    assert "step 40, which this process had passed (last step 40)" in a.error and a.to_dict()["missed_step"]
    boundary.passed(41)
    assert ran == []
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert [(r["id"], r["outcome"]) for r in audit] == [(a.id, "failed")]  # never queued: one line, the failure


def test_it_waits_for_its_step_and_runs_there(queue):
    from probe.training import boundary

    ran = []
    a = submit(queue, 42, ran)
    boundary.passed(41)
    assert (a.state, ran) == ("queued", [])
    boundary.passed(42)
    assert (a.state, a.step, ran, a.missed) == ("done", 42, [42], False)


def test_a_step_that_went_by_unseen_is_missed_not_run_late(queue, monkeypatch):
    from probe.training import boundary

    ran = []
    a = submit(queue, 41, ran)
    # the step tracker's quick path passed step 41 before the subscription was seen
    monkeypatch.setattr(boundary, "last_step", 41)
    boundary.passed(42)
    assert (a.state, a.missed, ran) == ("failed", True, [])
    assert queue._at_step not in boundary.after  # nothing left waiting


class Target:
    def __init__(self, rank, step, step_time=0.01):
        self.rank, self.label, self.pid = rank, f"rank {rank}", 1000 + rank
        self.step, self.step_time = step, step_time
        self.actions: dict[int, dict] = {}
        self.misses = 0  # this rank passes the first steps it is asked for (so many) before the request comes
        self.cancellable = True


class FakeClient:
    """The routes _drive_many uses, answered as a probe would: a submitted action at a step it has passed
    comes back failed and missed_step; a queued one is cancelled or, when not cancellable, has already run."""

    ids = iter(range(1, 1000))

    def __init__(self, target):
        self.t = target

    def get(self, path, timeout=None, **params):
        if path == "/health":
            return {"step": self.t.step, "step_time": self.t.step_time}
        a = self.t.actions[params["id"]]
        if a["state"] == "queued":  # the rank reaches the step and runs it
            a.update(state="done", step=a["at_step"])
        return {"action": dict(a)}

    def post(self, path, body, timeout=None):
        if path == "/actions/cancel":
            a = self.t.actions[body["id"]]
            a["state"] = "cancelled" if self.t.cancellable else "done"
            return {"action": dict(a)}
        a = {"id": next(self.ids), "state": "queued", "at_step": body.get("at_step"), "step": None}
        a["missed_step"] = False
        if self.t.misses:
            self.t.misses -= 1
            a.update(state="failed", missed_step=True, error="it was to run at step ..., which this process had passed")
        self.t.actions[a["id"]] = a
        return {"action": dict(a)}


class Session:
    timeout = 5.0

    def __init__(self):
        self.notes: list[str] = []

    def client(self, target):
        return FakeClient(target)

    def note(self, text):
        self.notes.append(text)


def drive(targets):
    from probe.cli.plumbing.actions import drive_many

    session = Session()
    outcomes = drive_many(session, "checkpoint", targets, [{"path": "x"} for _ in targets], queued=True)
    return session, outcomes


def test_the_common_step_is_ahead_by_the_lead_time_at_the_fastest_ranks_pace():
    from probe.cli.plumbing.actions import LEAD_S, common_step

    targets = [Target(0, 100, step_time=0.01), Target(1, 102, step_time=0.05)]
    step = common_step(Session(), targets)
    assert 102 + LEAD_S / 0.01 <= step < 102 + LEAD_S / 0.01 + 10  # plus whatever asking took, tripled
    slow = [Target(0, 7, step_time=30.0)]
    assert common_step(Session(), slow) == 9  # never fewer than STEP_MARGIN steps ahead
    fresh = [Target(0, None, step_time=None), Target(1, None, step_time=None)]
    assert common_step(Session(), fresh) == 2  # no step yet: still one step for all, not each rank's next


def test_a_rank_that_missed_the_step_makes_every_rank_try_again_later_at_one_step():
    targets = [Target(0, 100), Target(1, 100)]
    targets[1].misses = 1
    session, outcomes = drive(targets)
    first, second = (sorted(t.actions.values(), key=lambda a: a["id"]) for t in targets)
    assert [a["state"] for a in first] == ["cancelled", "done"]  # rank 0's first request was dropped before it ran
    assert [a["state"] for a in second] == ["failed", "done"]
    assert first[1]["at_step"] == second[1]["at_step"] > first[0]["at_step"]
    assert [o["state"] for o in outcomes] == ["done", "done"]
    assert {o["step"] for o in outcomes} == {second[1]["at_step"]}
    assert any("rank 1 had passed step" in n and "asking every rank again" in n for n in session.notes), session.notes


def test_when_the_others_cannot_be_cancelled_it_is_not_asked_again():
    targets = [Target(0, 100), Target(1, 100)]
    targets[1].misses = 1
    targets[0].cancellable = False  # rank 0 had already run it
    session, outcomes = drive(targets)
    assert [len(t.actions) for t in targets] == [1, 1]  # asked once: a second request would run it twice on rank 0
    assert outcomes[1]["missed_step"] and outcomes[1]["state"] == "failed"
    assert any("could not all be cancelled" in n for n in session.notes), session.notes


def test_a_rank_that_misses_every_try_leaves_no_rank_changed():
    from probe.cli.plumbing.actions import RETRIES

    targets = [Target(0, 100), Target(1, 100)]
    targets[1].misses = RETRIES + 1
    session, outcomes = drive(targets)
    assert [a["state"] for a in targets[0].actions.values()] == ["cancelled"] * (RETRIES + 1)
    assert outcomes[0]["state"] == "cancelled" and outcomes[1]["missed_step"]
    assert any(f"after {RETRIES + 1} tries: no rank did it" in n for n in session.notes), session.notes


def test_an_unreachable_rank_is_its_error_not_a_retry():
    targets = [Target(0, 100), Target(1, 100)]

    class Gone(FakeClient):
        def post(self, path, body, timeout=None):
            raise EndpointError("rank 1 is gone.")

    session = Session()
    session.client = lambda t: Gone(t) if t.rank == 1 else FakeClient(t)
    from probe.cli.plumbing.actions import drive_many

    outcomes = drive_many(session, "lr", targets, [{}, {}], queued=True)
    assert outcomes[0]["state"] == "done" and isinstance(outcomes[1], EndpointError)
    assert [len(t.actions) for t in targets] == [1, 0] and not session.notes
