"""``python -m tts_gateway``: the same as the ``tts-gateway`` command."""

from tts_gateway.gateway.cli import main

main()
