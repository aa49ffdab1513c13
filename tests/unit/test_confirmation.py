"""One "ask first" for every step: app.core.confirmation.NeedsConfirmation."""

from app.core.confirmation import NeedsConfirmation


def test_needs_confirmation_keeps_the_warnings_in_the_users_words():
    e = NeedsConfirmation(w for w in ["slot 1 holds 120 tokens", "the check restarts the server"])
    assert e.warnings == ["slot 1 holds 120 tokens", "the check restarts the server"]
    assert str(e) == "slot 1 holds 120 tokens; the check restarts the server"


def test_the_steps_raise_the_one_class():
    """The resume and the session service's checks ask through the same class: a caller catches one."""
    from app.sessions import resume, service

    assert not any(isinstance(v, type) and issubclass(v, Exception) and "Confirm" in k and v is not NeedsConfirmation
                   for mod in (resume, service) for k, v in vars(mod).items())
    assert resume.NeedsConfirmation is NeedsConfirmation and service.NeedsConfirmation is NeedsConfirmation
