"""The gateway's HTTP face: thin routes (parse → call a service → render), the
completion endpoints as raw ASGI routes, and the rendering of responses."""
