"""The wire: every message tether sends, declared once (``schema``), the sample as it travels and its
packing (``samples``), the codec, the ZeroMQ endpoints (``transport``) and CURVE keys bound to roles
(``security``).

Light on purpose (numpy, msgpack, pyzmq): the buffer imports it and never touches a model.
"""
