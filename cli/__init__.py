"""The `crucible` command: the local stack, `crucible train`, the demo, the tests, code generation."""

from crucible.shared.text import shown_lines


def echo(message: str = "") -> None:
    """Writes a message for the user's terminal. Task files, tasks, completions and errors quoting them
    are in such messages: every character a terminal would act on is written as its escape, line breaks
    aside (a task file's JSON key once set the window title, cleared the screen and printed a success
    line that was not true)."""
    print(shown_lines(message), flush=True)
