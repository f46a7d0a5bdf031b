"""The admission window's policy alone (engine/admission.py), without torch or threads: when it opens, how long it
waits for each arrival, and when it closes. tests/engine/test_batching.py checks that a burst through the engine
becomes one batch."""

from diffusiond.engine.admission import RETURN_WITHIN_S, AdmissionWindow


def test_opens_only_when_requests_wait_and_none_runs():
    window = AdmissionWindow(0.02, max_batch=8)
    assert window.opens(waiting=1, running=0)
    assert not window.opens(waiting=0, running=0)
    assert not window.opens(waiting=3, running=1)
    assert not AdmissionWindow(0.0, max_batch=8).opens(waiting=1, running=0)


def test_a_lone_burst_waits_short_gaps_until_the_deadline_or_a_full_batch():
    window = AdmissionWindow(0.04, max_batch=4)
    window.start(now=10.0)
    assert window.next_wait(waiting=1, now=10.0) == 0.04 / 40
    assert window.next_wait(waiting=3, now=10.03) == 0.04 / 40
    assert abs(window.next_wait(waiting=3, now=10.0395) - 0.0005) < 1e-9  # the deadline is nearer than a gap
    assert window.next_wait(waiting=3, now=10.05) is None  # past the deadline
    assert window.next_wait(waiting=4, now=10.0) is None  # a full batch


def test_clients_that_finished_together_are_waited_for_with_long_gaps():
    window = AdmissionWindow(0.04, max_batch=8)
    window.finished_together(3, now=5.0)
    window.start(now=5.5)
    assert window.next_wait(waiting=1, now=5.5) == 0.04 / 4  # two more of the three are expected
    assert window.next_wait(waiting=3, now=5.5) is None  # all three are back
    window.close()
    window.start(now=5.6)
    assert window.next_wait(waiting=1, now=5.6) == 0.04 / 40  # closed: nobody is expected any more


def test_a_return_older_than_a_second_expects_nobody():
    window = AdmissionWindow(0.04, max_batch=8)
    window.finished_together(5, now=1.0)
    window.start(now=1.0 + RETURN_WITHIN_S + 0.01)
    assert window.next_wait(waiting=1, now=2.02) == 0.04 / 40


def test_one_request_finishing_alone_is_not_a_round():
    window = AdmissionWindow(0.04, max_batch=8)
    window.finished_together(1, now=1.0)
    window.start(now=1.1)
    assert window.next_wait(waiting=1, now=1.1) == 0.04 / 40


def test_clients_coming_back_are_waited_for_up_to_a_step_of_their_round():
    """Answers leave one after another (each is encoded): a round whose returns spread beyond the window would split,
    and its late half run a step behind for good. Waiting up to a step costs the early ones no more than a step."""
    window = AdmissionWindow(0.02, max_batch=8)
    window.finished_together(8, now=5.0, step_s=0.08)
    window.start(now=5.01)
    assert window.next_wait(waiting=1, now=5.01) == 0.08 / 4
    assert window.next_wait(waiting=5, now=5.06) > 0  # past the 20 ms window, within the step
    assert window.next_wait(waiting=7, now=5.0901) is None  # a step has passed
    window.close()
    window.finished_together(8, now=6.0, step_s=0.005)  # a step shorter than the window: the window's own bounds
    window.start(now=6.0)
    assert window.next_wait(waiting=1, now=6.0) == 0.02 / 4
    assert window.next_wait(waiting=1, now=6.0201) is None


def test_a_split_round_joins_again():
    """A round that split finishes in two halves a step apart; the first half's clients come back during the second
    half's last step (submitted before it finished, taken in after). They wait for the second half's clients on top:
    counted among them, the window closed at once and the round stayed split for good (broken on purpose: red)."""
    window = AdmissionWindow(0.02, max_batch=8)
    window.finished_together(4, now=5.0, step_s=0.08, waiting=1)  # one of the first half already in the queue
    for submitted in (4.95, 4.97, 4.99):  # the rest of the first half, in the queue after the step
        window.arrived(submitted)
    window.start(now=5.01)
    assert window.next_wait(waiting=4, now=5.01) == 0.08 / 4  # the second half is expected on top
    assert window.next_wait(waiting=7, now=5.05) > 0
    assert window.next_wait(waiting=8, now=5.05) is None  # one round again
    window.close()
    window.finished_together(8, now=6.0, step_s=0.08)
    window.arrived(6.01)  # a returning client: not early
    window.start(now=6.01)
    assert window.next_wait(waiting=1, now=6.01) == 0.08 / 4
    assert window.next_wait(waiting=8, now=6.02) is None
