"""The Conversations tab: the proxy's conversations and their requests' verdicts."""
