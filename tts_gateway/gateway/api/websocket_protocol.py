"""uvicorn's WebSocket protocol (the ``websockets`` sans-I/O one), with a reason on every close it
makes itself: a text frame that is not UTF-8 is answered as every other bad message is, close code
1007 with a reason and one rate-limited warning with the client's address (uvicorn logs an error
with a traceback and closes without a reason); the close of a shutting-down server (1012) says so."""

from __future__ import annotations

import logging
from typing import Final

from uvicorn._types import WebSocketDisconnectEvent
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from tts_gateway.gateway.api.log_limits import RateLimitedLog, client_address

_INVALID_PAYLOAD: Final = 1007
_REASON: Final = "invalid message: a text frame that is not UTF-8"
_SERVICE_RESTART: Final = 1012
_SHUTDOWN_REASON: Final = "the gateway is shutting down"

logger = logging.getLogger(__name__)
_frames_log = RateLimitedLog(logger)


class GatewayWebSocketProtocol(WebSocketsSansIOProtocol):
    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type == "text" and not self.close_sent:
            try:
                b"".join(self.frames).decode()
            except UnicodeDecodeError as exc:
                self.frames = []
                where = client_address(self.client)
                _frames_log.log(logging.WARNING, "WebSocket from %s closed (1007): %s (%s)", where, _REASON, exc.reason)
                self.conn.send_close(_INVALID_PAYLOAD, _REASON)
                self.handle_parser_exception()
                return
        super().send_receive_event_to_app()

    def shutdown(self) -> None:
        if self.handshake_complete and not self.close_sent:
            # uvicorn's own close of an open socket at shutdown, with a reason; it then only closes the transport.
            closed: WebSocketDisconnectEvent = {
                "type": "websocket.disconnect",
                "code": _SERVICE_RESTART,
                "reason": _SHUTDOWN_REASON,
            }
            self.queue.put_nowait(closed)
            self.conn.send_close(_SERVICE_RESTART, _SHUTDOWN_REASON)
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.close_sent = True
        super().shutdown()
