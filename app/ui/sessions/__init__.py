"""The Sessions tab: parked sessions and the server's slots, park, resume, check, move."""
