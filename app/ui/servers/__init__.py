"""The Servers list, the server controller, the launch profile form, the Log tab and remote rows."""
