"""Board validation of any OpenAI-compatible server: the HTTP client and the join/leave load that
judges a server's answers by the margin rule. Imports check/, never engine/: what it judges is
somebody else's server."""
