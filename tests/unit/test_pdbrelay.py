"""The notebook's side of breakpoint() on a rank (cells/pdbrelay.py), with the rank's messages made by hand."""

from __future__ import annotations

from nbdist.cells.pdbrelay import Relay


def prompt(rank: int, text: str = "") -> dict:
    return {"state": "prompt", "rank": rank, "text": text, "prompt": f"(Pdb rank {rank}) "}


class Person:
    def __init__(self, *lines: str) -> None:
        self.lines, self.asked, self.sent, self.said = list(lines), [], [], []

    def ask(self, text: str) -> str:
        self.asked.append(text)
        return self.lines.pop(0)

    def send(self, rank: int, line: str) -> str:
        self.sent.append((rank, line))
        return ""

    def relay(self) -> Relay:
        return Relay(self.send, ask=self.ask, say=self.said.append)


def test_one_rank_at_a_time_each_named_and_the_second_waits_its_turn():
    person = Person("p x", "c", "c")
    relay = person.relay()
    relay.take(1, prompt(1, "> cell(3)\n-> breakpoint()\n"))
    relay.take(0, prompt(0, "> cell(3)\n-> breakpoint()\n"))
    assert relay.active
    assert relay.answer() and person.sent == [(1, "p x")], "the first to stop is debugged first"
    assert "rank 1 stopped at a breakpoint" in person.said[0] and "rank(s) 0 stopped too" in person.said[0]
    assert not relay.answer(), "rank 1 runs its command: rank 0 still waits, nothing is asked"
    relay.take(1, prompt(1, "41\n"))
    assert relay.answer() and person.sent[-1] == (1, "c") and person.said[-1] == "41"
    relay.take(1, {"state": "left", "text": ""})
    assert relay.answer() and person.sent[-1] == (0, "c"), "rank 1 went on: rank 0's turn"
    assert person.asked == ["(Pdb rank 1) ", "(Pdb rank 1) ", "(Pdb rank 0) "]
    relay.take(0, {"state": "left", "text": ""})
    assert not relay.active and not relay.answer()


def test_a_rank_whose_cell_ended_waits_for_nothing():
    relay = Person().relay()
    relay.take(0, prompt(0))
    relay.ended(0)
    assert not relay.active and not relay.prompts


def test_a_refused_line_is_said_and_the_rank_no_longer_counts_as_debugged():
    person = Person("p x")
    relay = Relay(lambda rank, line: "its process ended", ask=person.ask, say=person.said.append)
    relay.take(2, prompt(2))
    assert relay.answer()
    assert person.said[-1] == "rank 2 did not take 'p x': its process ended"
    assert not relay.active, "the watch's timers run again"


def test_no_input_box_lets_the_rank_go_on_and_says_so():
    from IPython.core.error import StdinNotImplementedError  # what input() raises under nbclient

    for error in (EOFError, StdinNotImplementedError):

        def no_stdin(text: str, error=error) -> str:
            raise error

        person = Person()
        sent, said = person.sent, person.said
        relay = Relay(person.send, ask=no_stdin, say=said.append)
        relay.take(0, prompt(0))
        relay.answer()
        assert sent == [(0, "c")] and said[-1] == "no input box here to type into: rank 0 goes on (c)"
