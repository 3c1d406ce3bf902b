"""The HTTP transport every HTTP engine family's driver is built on: the row an endpoint table
is made of (``rows``), sending a row with its keys, retries and error boundary
(``transport``), and the client timeouts and checks of values sent (``wire``)."""
