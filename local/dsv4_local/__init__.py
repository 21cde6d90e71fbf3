"""`dsv4 up`: a DSV4Deployment as local processes on 127.0.0.1."""
