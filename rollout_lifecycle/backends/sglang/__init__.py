"""SGLang's driver: its endpoint table (``api``), a client's link to one server (``link``), the
client (``client``: ``SGLangHTTPEngine``, which declares SGLang's capabilities) and the
launcher of SGLang servers (``launch``)."""
