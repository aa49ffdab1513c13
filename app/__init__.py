"""KV Valet: park and resume llama-server sessions."""

import warnings

__version__ = "0.1.0"

# asyncssh (remote hosts) names DSA key types when it is imported, which cryptography 51 deprecates with a
# warning on stderr: a library's notice to its own authors, printed on every command that reaches a host
# (and breaking the CLI's "error: ..." first line there). Only that notice, only from asyncssh, is hidden.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh\.")
