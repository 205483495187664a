"""The heartbeat's judgement of a peer: stalled only when its thread ran and its step did not
progress, look after look; a peer that was not scheduled at all is no evidence."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from meshpact.live.recovery.heartbeat import PROGRESS, watch


def _judge(beats: list[tuple[int, int]], misses: int = 3) -> list[bool]:
    """Feed a peer's beats (thread ran, main progressed) look by look; stalled after each look?"""
    count, still, out = 7 * PROGRESS + 11, 0, []  # a counter that already holds earlier beats
    for ran, progressed in beats:
        now = count + ran + progressed * PROGRESS
        still = watch(count, now, still)
        count = now
        out.append(still >= misses)
    return out


def test_a_peer_whose_thread_beats_without_progress_is_stalled_after_the_misses():
    assert _judge([(1, 0)] * 4) == [False, False, True, True]
    assert _judge([(1, 0)] * 5, misses=5) == [False] * 4 + [True]


def test_progress_resets_and_a_peer_not_scheduled_is_never_taken_for_stalled():
    assert _judge([(1, 0), (1, 0), (1, 1), (1, 0), (1, 0)]) == [False] * 5
    # a loaded machine: the peer's process got no CPU for 40 looks (nothing moved), then ran
    assert not any(_judge([(0, 0)] * 40 + [(1, 1)]))
    # starved looks neither count nor reset: two misses, a starved stretch, one more miss
    assert _judge([(1, 0), (1, 0)] + [(0, 0)] * 10 + [(1, 0)]) == [False] * 12 + [True]
    # several beats between two looks (the watcher was the one starved): progress among them wins
    count = 3 * PROGRESS + 5
    assert watch(count, count + 4 + PROGRESS, 2) == 0
    assert watch(count, count + 4, 2) == 3


# -- a quiet data path: every rank waiting in a collective, not a byte moving ----------------------------
def test_the_alarm_needs_every_rank_quiet_for_the_misses_each_word_fresh():
    from meshpact.live.recovery.heartbeat import QuietWord, all_quiet

    last = {0: 4, 1: 9, 2: 2}
    quiet = {0: QuietWord(5, 3), 1: QuietWord(10, 4), 2: QuietWord(3, 3)}
    assert all_quiet(quiet, last, misses=3)
    # one rank computing (its data path not quiet long enough) keeps it off
    assert not all_quiet({**quiet, 1: QuietWord(10, 2)}, last, misses=3)
    # a rank whose thread was not scheduled since the last read: its word is stale, no evidence
    assert not all_quiet({**quiet, 2: QuietWord(2, 7)}, last, misses=3)
    # a rank with no word yet, or one never read before (a replacement's first word)
    assert not all_quiet({**quiet, 2: None}, last, misses=3)
    assert not all_quiet(quiet, {0: 4, 1: 9}, misses=3)
    assert not all_quiet({}, {}, misses=3)


def test_a_quiet_word_survives_the_store_and_garbage_is_no_word():
    from meshpact.live.recovery.heartbeat import QuietWord

    w = QuietWord(123456789, 17, 4)
    assert QuietWord.decode(w.encode().encode()) == w and QuietWord.decode(w.encode()) == w
    assert QuietWord.decode(QuietWord(1, 0).encode()) == QuietWord(1, 0, -1)
    assert QuietWord.decode(b"12") is None and QuietWord.decode(b"a:b:c") is None
    assert QuietWord.decode(b"\xff:1:2") is None and QuietWord.decode("1:2") is None


def test_a_main_thread_asleep_while_the_intra_op_pool_works_has_progressed():
    from meshpact.live.recovery.heartbeat import Look, progressed

    asleep = Look(watching=True, in_comm=False, moved=False, main_cpu_s=0.0, state="S", native_cpu_s=0.0)
    assert not progressed(asleep)  # a stall: asleep, nothing working for it
    assert progressed(
        Look(True, False, False, 0.0, "S", native_cpu_s=0.03, in_torch=True)
    )  # an optimizer step on the pool
    assert not progressed(Look(True, False, False, 0.0, "S", native_cpu_s=0.03))  # asleep in the user's code
    assert progressed(Look(True, False, False, 0.0, "D", 0.0))  # faulting in a large tensor's pages
    assert progressed(Look(False, False, False, 0.0, "S", 0.0))  # between steps nothing is judged


def test_a_busy_python_thread_is_not_counted_as_native_work():
    import threading
    import time

    from meshpact.live.recovery.heartbeat import Heartbeat

    go, done = threading.Event(), threading.Event()

    def spin() -> None:  # a peer server's receive, say: Python's own thread, not working for the step
        go.wait()
        while not done.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    before = Heartbeat._native_cpu_s()
    go.set()
    time.sleep(0.2)
    during = Heartbeat._native_cpu_s() - before  # measured while the thread is alive
    done.set()
    t.join()
    assert during < 0.02, during


# -- the alarm: kept only for the step it ends, never held back by an earlier generation's ---------------
def _heartbeat(generation: int, watching: bool):
    import threading
    from types import SimpleNamespace

    from meshpact.live.recovery.heartbeat import Heartbeat

    hb: Any = Heartbeat.__new__(Heartbeat)  # no thread, no control channel: the alarm's bookkeeping alone
    severed: list[int] = []

    def sever(tell_peers: bool) -> int:
        severed.append(generation)
        return 0

    hb.session = SimpleNamespace(generation=generation, sever_lock=threading.Lock(), sever_data_path=sever)
    hb.watching, hb.alarm, hb._detected_generation, hb._alarm_lock = watching, None, None, threading.Lock()
    return hb, severed


def test_an_alarm_raised_once_its_step_ended_is_not_kept_for_a_later_generation():
    from meshpact.live.recovery.heartbeat import HeartbeatAlarm

    hb, severed = _heartbeat(4, watching=False)  # the step raised on its own and its recovery took the alarms
    hb._raise(HeartbeatAlarm(1.0), 4)
    assert hb.alarm is None and severed == []
    hb.watching = True
    hb._raise(HeartbeatAlarm(2.0), 4)
    assert hb._alarmed(4) and severed == [4] and hb.take() == HeartbeatAlarm(2.0) and hb.alarm is None


def test_an_alarm_left_from_an_earlier_generation_does_not_hold_back_this_ones():
    from meshpact.live.recovery.heartbeat import HeartbeatAlarm

    hb, severed = _heartbeat(7, watching=True)
    hb.alarm, hb._detected_generation = HeartbeatAlarm(1.0), 6  # raised in generation 6, never taken
    assert not hb._alarmed(7)  # so a peer's recovery of generation 7 still severs this rank's blocked step
    hb._raise(HeartbeatAlarm(3.0), 7)
    assert severed == [7] and hb.take() == HeartbeatAlarm(3.0)


# -- the stall bound follows the job's own pauses ------------------------------------------------------
def test_the_stall_bound_is_the_margin_times_the_usual_pause_never_under_the_misses():
    from meshpact.live.recovery.heartbeat import stall_bound

    assert stall_bound(None, 3, 4.0) is None  # no completed step yet: no evidence, no alarm
    assert stall_bound(0, 3, 4.0) == stall_bound(0, 3, 1.0) == 3
    assert stall_bound(8, 3, 4.0) == 32 and stall_bound(3, 3, 1.5) == 5  # rounded up


def test_a_peer_is_stalled_only_past_the_bound_its_own_published_pause_gives():
    from types import SimpleNamespace

    from meshpact.live.recovery.heartbeat import Heartbeat, pause_key

    published = {pause_key(1): "8", pause_key(2): "0"}  # rank 3 has completed no step
    reads: list[list[str]] = []

    def peek(keys):
        reads.append(list(keys))
        return [published.get(k) for k in keys]

    hb = Heartbeat.__new__(Heartbeat)
    hb.misses, hb.stall_margin = 3, 4.0
    hb.channel = SimpleNamespace(peek=peek)
    ranks = (0, 1, 2, 3)
    assert hb._stalled(ranks, [0, 2, 2, 2]) == [] and reads == []  # under the least bound: nothing read
    assert hb._stalled(ranks, [0, 3, 3, 40]) == [2]  # rank 1 pauses 8 looks in a healthy step: 32 allowed
    assert hb._stall_detail == "rank 2: 3 looks without progress, bound 3 (usual pause 0)"  # the alarm's record
    assert reads[-1] == [pause_key(1), pause_key(2), pause_key(3)]  # one round trip for every candidate
    assert hb._stalled(ranks, [0, 31, 0, 0]) == []
    published[pause_key(1)] = "2"  # its word shrank (a step run again ended): read as it is now
    assert hb._stalled(ranks, [0, 9, 0, 0]) == [1]


def test_a_step_run_again_may_pause_as_long_as_its_failed_attempt_until_it_completes():
    from meshpact.live.recovery.heartbeat import Heartbeat

    hb = Heartbeat.__new__(Heartbeat)
    hb.usual_pause, hb.allowance, hb._pause, hb._step_pause, hb.steps_completed = None, 0, 0, 0, 0
    hb.step_begins()
    hb._step_pause = 60  # the process's first step: building, compiling, a loader starting
    hb.step_completed()
    assert hb.pause_word() is None  # the warm-up teaches nothing, and nothing is judged yet
    hb.step_begins()
    hb._step_pause = 2
    hb.step_completed()
    assert hb.pause_word() == 2
    hb.step_begins()
    hb._step_pause = 30  # an evaluation inside the step, or a stall: the peers sever it
    hb.step_begins(again=True)  # the recovered step runs again: its pause comes back with it, if it is its own
    assert hb.pause_word() == 30 and hb._step_pause == 0
    hb._step_pause = 1  # a stall does not come back: the step ends without it
    hb.step_completed()
    assert hb.pause_word() == 2  # the allowance ended with the step; the usual pause is as before
    hb.step_begins()
    hb._step_pause = 30
    hb.step_begins(again=True)
    hb._step_pause = 30  # the evaluation again: this time the step completes, and its pause is a usual one
    hb.step_completed()
    assert hb.pause_word() == 30


def test_waiting_for_torchs_compiler_is_progress_but_not_a_quiet_data_path():
    from meshpact.live.recovery.heartbeat import Look, progressed

    waiting = Look(watching=True, in_comm=False, moved=False, main_cpu_s=0.0, state="S", native_cpu_s=0.0)
    assert not progressed(waiting)  # asleep, on nothing of torch's: a pause
    assert progressed(
        Look(watching=True, in_comm=False, moved=False, main_cpu_s=0.0, state="S", native_cpu_s=0.0, compiling=True)
    )  # its compile workers or the C++ compiler work for it


@pytest.mark.parametrize("state, working", [(b"R", True), (b"D", True), (b"S", False)])
def test_a_thread_in_an_uninterruptible_wait_keeps_the_data_path_from_reading_quiet(monkeypatch, state, working):
    # a gloo thread faulting in the pages of a buffer it is about to send (or reclaiming memory) is in the
    # kernel's D state: its bytes have not moved yet, but they will; only threads asleep leave a rank quiet
    import io
    import threading

    from meshpact.live.recovery import heartbeat as hbmod

    me = threading.get_native_id()
    monkeypatch.setattr(hbmod.os, "listdir", lambda path: [str(me), "999999"])
    monkeypatch.setattr(
        hbmod, "open", lambda path, mode="r": io.BytesIO(b"999999 (pt_main (x)) " + state + b" 1 2 3"), raising=False
    )
    assert hbmod.Heartbeat.__new__(hbmod.Heartbeat)._others_working() is working


def test_a_replacement_is_not_judged_by_the_pause_its_killed_predecessor_published():
    # the killed process of rank 1 published a usual pause of 0 looks; its replacement, in its first step,
    # must not be called stalled after 3 looks: it clears the word as its heartbeat starts
    import json
    from types import SimpleNamespace

    from meshpact.live.recovery.heartbeat import Heartbeat, pause_key

    store = {pause_key(0): json.dumps("0"), pause_key(1): json.dumps("0")}
    channel = SimpleNamespace(
        set=lambda k, v: store.__setitem__(k, json.dumps(v)),
        peek=lambda keys: [json.loads(store[k]) if k in store else None for k in keys],
    )
    peer = Heartbeat.__new__(Heartbeat)
    peer.misses, peer.stall_margin, peer.channel = 3, 4.0, channel
    assert peer._stalled((0, 1), [0, 3]) == [1]  # the stale word would call it stalled
    replacement = Heartbeat.__new__(Heartbeat)
    replacement.channel, replacement.session = channel, SimpleNamespace(rank=1)
    replacement.clear_pause_word()
    assert peer._stalled((0, 1), [0, 30]) == []  # no word: no evidence, no alarm
    store[pause_key(1)] = json.dumps("2")  # it completed its second step and published
    assert peer._stalled((0, 1), [0, 8]) == [1]


def test_a_model_built_anew_by_an_excision_warms_up_again_before_any_bound_applies():
    from meshpact.live.recovery.heartbeat import Heartbeat

    hb = Heartbeat.__new__(Heartbeat)
    hb.usual_pause, hb.allowance, hb._pause, hb._step_pause, hb.steps_completed = None, 0, 0, 0, 0
    hb._forget_word = False
    for pause in (40, 1):  # the warm-up, then a steady step
        hb.step_begins()
        hb._step_pause = pause
        hb.step_completed()
    assert hb.pause_word() == 1
    hb.warm_up_again()  # the excision's rebuilt model: its first step lazily initialises, allocates the new sizes
    assert hb.pause_word() is None and hb._forget_word  # the thread publishes "no word" at its next look
    hb.step_begins(again=True)
    hb._step_pause = 12
    hb.step_completed()
    assert hb.pause_word() is None  # the new model's warm-up teaches no usual pause
    hb.step_begins()
    hb._step_pause = 2
    hb.step_completed()
    assert hb.pause_word() == 2  # judged again from its second completed step on the new model


def _listening_heartbeat(
    told: object,
    running_step: int,
    data: Callable[[], Any] | None = None,
    data_timeout_s: float = 30.0,
    running_block: int = -1,
) -> tuple[object, list[float], object]:
    """A heartbeat whose listener hears ``told`` under its key while its rank runs ``running_step``
    (or, ``running_block`` >= 0, that block between steps before it),
    its data path's byte count read from ``data()`` (None: none to read); each raise is recorded
    (its time) and ends the generation."""
    import threading
    import time
    from types import SimpleNamespace

    from meshpact.live.recovery.heartbeat import Heartbeat

    raised: list[float] = []
    hb: Any = Heartbeat.__new__(Heartbeat)
    hb._stop = threading.Event()
    hb.session = SimpleNamespace(generation=3, rank=2, spec=SimpleNamespace(timeout_s=data_timeout_s))
    hb.alarm, hb._detected_generation = None, None
    hb.watching, hb.running_step, hb.running_block = True, running_step, running_block
    hb._told, hb._recovering, hb._recovered, hb.opened_wall, hb._heard = None, None, threading.Event(), 0.0, None
    hb._data_bytes = lambda generation: data() if data is not None else None
    heard = iter(told if isinstance(told, list) else [told])
    hb.asked = []  # the keys the listener waited on, in order

    def wait(keys, timeout_s=None):
        hb.asked.append(keys[0])
        try:
            return {keys[0]: next(heard)}
        except StopIteration:
            raise RuntimeError("the channel is gone") from None  # the listener returns

    def raise_(alarm, generation):
        raised.append(time.monotonic())
        hb.session.generation += 1

    hb.listener = SimpleNamespace(wait=wait)
    hb._raise = raise_
    thread = threading.Thread(target=hb._listen, daemon=True)
    return hb, raised, thread


def _moving() -> object:
    """A data path whose byte count grows at every read (a collective's last pieces arriving)."""
    import itertools

    count = itertools.count(0, 4096)
    return lambda: next(count)


def test_a_rank_still_in_the_step_before_the_failed_one_finishes_it_before_its_sever():
    """A peer failed in step 5 while this rank still receives the last pieces of step 4 (a step's last
    collective ends at different times on each rank): cut now, this rank would fail one committed
    step behind the others and the job would restore its checkpoint. Its listener lets step 4 end
    while its bytes move and severs once step 5 runs; a rank in the failed step, told without a
    step, or whose data path cannot be read, is severed at once."""
    import time

    hb, raised, thread = _listening_heartbeat({"rank": 0, "step": 5}, running_step=4, data=_moving())
    thread.start()
    time.sleep(0.3)
    assert raised == []  # step 4 still moves its bytes: not cut
    began = time.monotonic()
    hb.running_step = 5  # step 4 ended and was committed; step 5 begins (it waits on the failed peer)
    thread.join(5.0)
    assert len(raised) == 1 and raised[0] - began < 1.0
    for told, step, data in (
        ({"rank": 0, "step": 5}, 5, _moving()),
        (0, 4, _moving()),
        ({"rank": 0, "step": 5}, 4, None),
    ):
        hb, raised, thread = _listening_heartbeat(told, running_step=step, data=data)
        start = time.monotonic()
        thread.start()
        thread.join(5.0)
        assert len(raised) == 1 and raised[0] - start < 1.0


def test_a_rank_still_in_the_evaluation_before_the_failed_step_finishes_it_before_its_sever():
    """A peer failed in step 5 while this rank still receives the last pieces of the evaluation
    (``rt.run``) that comes before step 5: cut now, it would re-run the evaluation while its peers
    re-run the step. It finishes the evaluation while its bytes move and is severed in step 5; a
    rank in the block where the peer failed, or in an earlier one than the peer's, is severed at once."""
    import time

    hb, raised, thread = _listening_heartbeat({"rank": 0, "step": 5}, running_step=5, data=_moving(), running_block=0)
    thread.start()
    time.sleep(0.3)
    assert raised == []  # the evaluation still moves its bytes: not cut
    began = time.monotonic()
    hb.running_block = -1  # the evaluation ended; step 5 begins
    thread.join(5.0)
    assert len(raised) == 1 and raised[0] - began < 1.0
    for told, block in (({"rank": 0, "step": 5, "block": 0}, 0), ({"rank": 0, "step": 5, "block": 1}, 1)):
        hb, raised, thread = _listening_heartbeat(told, running_step=5, data=_moving(), running_block=block)
        start = time.monotonic()
        thread.start()
        thread.join(5.0)
        assert len(raised) == 1 and raised[0] - start < 1.0
    hb, raised, thread = _listening_heartbeat(
        {"rank": 0, "step": 5, "block": 1}, running_step=5, data=_moving(), running_block=0
    )
    thread.start()
    time.sleep(0.3)
    assert raised == []  # block 0 ends before the peer's block 1
    hb.session.generation += 1  # (ends the listener)
    thread.join(5.0)


def test_a_listener_told_during_its_own_ranks_recovery_severs_nothing_and_waits_again_once_it_ends():
    """The rank already recovers out of generation 3 (its own step failed first) when a peer's key
    comes: the listener severs nothing, sleeps through the recovery, and waits on generation 4's
    key only once the recovery ended (its first collective ran): a peer's key set meanwhile is
    found at once then. A peer's key marks the rank told (it tells nobody); its own key does not."""
    import time

    from meshpact.live.recovery.heartbeat import recovering_key

    for teller, told in ((0, True), (2, False)):
        hb, raised, thread = _listening_heartbeat([{"rank": teller, "step": 5}], running_step=5)
        hb.watching = False  # a recovery runs no step
        hb.recovery_begins(3)
        thread.start()
        deadline = time.monotonic() + 5.0
        while not hb.opened_wall and time.monotonic() < deadline:  # the key was heard
            time.sleep(0.005)
        assert hb.told_of(3) is told and not hb.told_of(4)
        hb.session.generation = 4  # the recovery rebound its groups: its first collective still runs
        time.sleep(0.2)  # (long enough to see it wait again too early, were it to)
        assert raised == [] and hb.asked == [recovering_key(3, 2)]
        hb.recovery_ends()
        thread.join(5.0)  # the fake channel ends once asked again
        assert raised == [] and hb.asked == [recovering_key(3, 2), recovering_key(4, 2)]


def test_a_rank_that_told_the_others_ends_its_own_listeners_wait_once_its_recovery_ended():
    """Rank 2 failed first and told every other rank; nobody tells it, so its listener still waits
    on generation 3's key when the recovery has moved the rank to generation 4. The rank sets
    that key itself once the recovery ended (not as it began: the listener woken then took
    CPU in the middle of the recovery), and the listener waits on generation 4's."""
    import threading
    import time
    from types import SimpleNamespace

    from meshpact.live.recovery.heartbeat import recovering_key

    keys: dict[str, object] = {}
    changed = threading.Condition()
    hb, raised, thread = _listening_heartbeat([], running_step=5)

    def wait(asked, timeout_s=None):
        hb.asked.append(asked[0])
        with changed:
            if not changed.wait_for(lambda: asked[0] in keys, timeout=2.0):
                raise RuntimeError("the channel is gone")  # the listener returns
            return {asked[0]: keys[asked[0]]}

    def set_(key, value):
        with changed:
            keys[key] = value
            changed.notify_all()

    hb.listener = SimpleNamespace(wait=wait)
    hb.session.control = SimpleNamespace(set_many=lambda ks, value: [set_(k, value) for k in ks])
    thread.start()
    hb.recovery_begins(3)
    hb.watching = False
    hb.session.generation = 4  # rebound; the first collective runs
    time.sleep(0.2)  # (long enough to see the key set too early, were it to be)
    assert keys == {} and hb.asked == [recovering_key(3, 2)]
    hb.recovery_ends()
    thread.join(5.0)
    assert list(keys) == [recovering_key(3, 2)] and hb.asked == [recovering_key(3, 2), recovering_key(4, 2)]
    assert raised == [] and not hb.told_of(3)


def test_a_listener_whose_alarm_came_as_the_step_ended_severs_the_next_step():
    """The rank was in the failed step's generation when told, but its step ended between the
    listener's look and its raise (nothing severed, no alarm kept). Its next step waits on the
    recovering peer, which hears nothing from it: the listener keeps looking and severs that
    step, instead of sleeping through the generation while the step waits out its timeout."""
    import time

    hb, raised, thread = _listening_heartbeat({"rank": 0, "step": 5}, running_step=5)
    tries: list[float] = []

    def raise_(alarm, generation):
        tries.append(time.monotonic())
        if len(tries) > 1:  # the first came as step 5 ended; the second meets step 6 running
            raised.append(time.monotonic())
            hb.session.generation += 1

    hb._raise = raise_
    thread.start()
    thread.join(5.0)
    assert len(tries) == 2 and len(raised) == 1


def test_a_rank_one_step_behind_whose_data_path_stops_or_never_ends_is_severed():
    """Its step waits on a rank that is gone (a kill's survivor): nothing moves, and it is cut after
    the quiet bound, not held. A step behind whose bytes move on and on is cut at the data-path timeout."""
    import time

    from meshpact.live.recovery import heartbeat

    hb, raised, thread = _listening_heartbeat({"rank": 0, "step": 5}, running_step=4, data=lambda: 7)
    start = time.monotonic()
    thread.start()
    thread.join(5.0)
    assert len(raised) == 1 and heartbeat._BEHIND_QUIET_S <= raised[0] - start < 1.0
    hb, raised, thread = _listening_heartbeat(
        {"rank": 0, "step": 5}, running_step=4, data=_moving(), data_timeout_s=0.4
    )
    start = time.monotonic()
    thread.start()
    thread.join(5.0)
    assert len(raised) == 1 and 0.4 <= raised[0] - start < 2.0


def test_a_quiet_word_is_published_when_it_changes_and_at_every_quiet_look_not_at_every_look():
    """Each look's word costs a round trip to the control channel's host at every rank. A word
    saying "not quiet" stays true until the rank is quiet again, and a peer reading it (stale or
    not) keeps the alarm off, so it is published once; every quiet look is published (its beat
    makes it fresh), and so is the return to "not quiet"."""
    from meshpact.live.recovery.heartbeat import QuietWord

    hb, calls = _looking_heartbeat(
        [1, 2, 3, 3, 3, 4, 5, 6]
    )  # the data path's bytes at each look: quiet twice, then moving
    hb._run()
    assert hb.failed_looks == 0
    published = [QuietWord.decode(v) for name, k, v in calls if name == "set" and "quiet" in k]
    assert [(w.beat, w.quiet) for w in published] == [(1, 0), (4, 1), (5, 2), (6, 0)]


def test_a_look_during_the_ranks_own_recovery_beats_and_reads_nothing_else():
    """Looks that land in the rank's own recovery judge nothing (no step is watched, here or at a
    peer): one beat each, no reads of the peers' counters or of the process, which would take CPU
    from the recovery; the first look after it judges afresh."""
    from meshpact.live.recovery.heartbeat import PROGRESS

    hb, calls = _looking_heartbeat([1, 2, 3], looks=5)
    hb._recovering = 3
    seen_process = []
    hb._main_position = lambda: seen_process.append(1) or (1, 1, True, True, False)
    hb._run()
    assert hb.failed_looks == 0 and seen_process == [1]  # the thread's start only
    assert [c[0] for c in calls] == ["add"] * 5 and all(c[2] == 1 + PROGRESS for c in calls)


def _looking_heartbeat(moved: list[int], looks: int = 8) -> tuple[object, list[tuple[str, object, object]]]:
    """A heartbeat whose thread runs ``looks`` looks (then stops) on a rank waiting in communication
    code, its data path's bytes read from ``moved``, its control channel calls recorded."""
    import threading
    from types import SimpleNamespace

    from meshpact.live.recovery.heartbeat import Heartbeat

    data = iter(moved)
    calls: list[tuple[str, object, object]] = []
    hb: Any = Heartbeat.__new__(Heartbeat)
    hb._stop = threading.Event()

    def add(key, n):
        calls.append(("add", key, n))
        if sum(1 for c in calls if c[0] == "add") == looks:
            hb._stop.set()

    def counters(keys):
        calls.append(("counters", keys, None))
        return [len(calls)] * len(keys)

    hb.channel = SimpleNamespace(
        add=add, peek=lambda keys: [None] * len(keys), counters=counters, set=lambda k, v: calls.append(("set", k, v))
    )
    hb.session = SimpleNamespace(rank=0, generation=1, members=(0, 1))
    hb.interval_s, hb.misses, hb.quiet_rule, hb.watching = 0.001, 3, True, True
    hb._pause = hb._step_pause = 0
    hb._forget_word, hb.usual_pause, hb.allowance = False, None, 0
    hb.alarm, hb._detected_generation, hb.failed_looks, hb._recovering = None, None, 0, None
    hb._main_position = lambda: (1, 1, True, True, False)  # waiting in communication code
    hb._main_cpu_s = hb._native_cpu_s = lambda: 0.0
    hb._main_state = lambda: "S"
    hb._others_working = lambda: False
    hb._data_bytes = lambda generation: next(data)
    hb._stalled = lambda ranks, still: []
    return hb, calls


def test_each_rank_watches_its_next_members_on_the_ring_and_is_watched_by_as_many():
    from collections import Counter

    from meshpact.live.recovery.heartbeat import WATCH_FANOUT, watched_peers

    members = (0, 2, 3, 5, 8, 9)  # an excised job's members are not 0..n-1
    assert watched_peers(8, members) == (9, 0)
    assert watched_peers(9, members) == (0, 2)
    watchers = Counter(p for r in members for p in watched_peers(r, members))
    assert set(watchers) == set(members) and set(watchers.values()) == {WATCH_FANOUT}
    assert all(r not in watched_peers(r, members) for r in members)
    assert watched_peers(1, (0, 1)) == (0,)  # two ranks: each the other's only watcher
    assert watched_peers(0, (0,)) == ()


@pytest.mark.parametrize("world", [4, 4096])
def test_a_looks_store_reads_do_not_grow_with_the_job(world):
    """A rank that is not the quiet judge reads WATCH_FANOUT counters and one quiet word a look,
    whatever the job's size; the judge alone reads every word."""
    from meshpact.live.recovery.heartbeat import WATCH_FANOUT

    for rank, words in ((1, 1), (0, world)):
        hb, calls = _looking_heartbeat([1, 1, 1, 1, 1, 1, 1, 1])  # quiet from the second look on
        hb.session.rank, hb.session.members = rank, tuple(range(world))
        peeked: list[int] = []
        hb.channel.peek = lambda keys: peeked.append(len(keys)) or [None] * len(keys)
        hb._run()
        assert hb.failed_looks == 0
        assert {len(keys) for name, keys, _ in calls if name == "counters"} == {WATCH_FANOUT}
        assert peeked and set(peeked) == {words}


def test_the_judge_finds_every_rank_quiet_says_so_at_once_and_a_rank_reading_its_word_severs():
    from meshpact.live.recovery.heartbeat import QuietWord, quiet_key

    raised: list[tuple[int, object]] = []

    def judged(rank, peek):
        hb, calls = _looking_heartbeat([1] * 8)
        hb.session.rank, hb.session.members = rank, (0, 1, 2)
        hb.channel.peek = peek
        hb._alarmed = lambda generation: any(r == rank for r, _ in raised)
        hb._raise = lambda alarm, generation: raised.append((rank, alarm))
        hb._run()
        return calls

    beats = iter(range(100, 10_000))

    def all_quiet_words(keys):  # every rank quiet for many looks, each word fresh at every read
        return [QuietWord(next(beats), 9).encode() for _ in keys]

    calls = judged(0, all_quiet_words)
    assert [r for r, _ in raised] == [0] and raised[0][1].data_path_quiet
    said = [QuietWord.decode(v) for name, k, v in calls if name == "set" and k == quiet_key(0)]
    assert said[-1].hung == 1  # the generation it found hung, published in the look that raised

    raised.clear()
    judged(2, lambda keys: [QuietWord(5, 0, hung=1).encode()] * len(keys))  # a rank reading the judge's word
    assert [r for r, _ in raised] == [2] and raised[0][1].data_path_quiet

    raised.clear()
    judged(2, all_quiet_words)  # a rank that is not the judge never judges every rank quiet itself
    assert raised == []
