"""Python + crypto cost of the holder's send path per GiB, kernel excluded (a socket whose
sendmsg takes everything at once)."""
import os, socket, time
import elasticd.replication.channel as chmod
from elasticd.replication.channel import Channel, send_spans, frame_chunk
from elasticd.replication.seal import FrameKey, BlockTags
from elasticd.replication.wire import DEFAULT_MAX_FRAME

class Sock(socket.socket):
    def sendmsg(self, views):
        return sum(len(v) for v in views)

GIB = 1 << 30
BLOCK = 4 << 20
buf = memoryview(bytearray(GIB + 64))
tags = BlockTags(os.urandom(16), {64 + i * BLOCK: (BLOCK, os.urandom(16)) for i in range(GIB // BLOCK)})
s = Sock()
ch = Channel(s)
ch.send_key = FrameKey(os.urandom(32))
chunk = frame_chunk(8 << 20, DEFAULT_MAX_FRAME)
for _ in range(5):
    c = time.process_time()
    frames = send_spans(ch, [(64, buf[64:])], chunk, tags, DEFAULT_MAX_FRAME)
    print(f"frames {frames}: {1e3*(time.process_time()-c):.2f} ms CPU per GiB")
s.close()
