"""HTTP routers: parse, call one service, choose the response type."""
