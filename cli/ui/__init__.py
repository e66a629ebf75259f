"""``probe ui``: a live web page of the job, served from the CLI process.

The page is a client like the CLI: its server (``server``) answers the page's requests
through the CLI's session, client and fan-out (``api``); the page itself is static files
under ``static/`` (hand-written JS and SVG, no build step, nothing fetched from elsewhere).
"""
