"""ClientApp of the latency benchmark: returns the received arrays unchanged (no training) with
num-examples=1, so a round measures only Flower's message round trip and ClientApp start-up."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays: ArrayRecord = msg.content["arrays"]
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)
