#!/usr/bin/env node
// A batcher client in Node.js, written from docs/protocol.md: zeromq (v6) and
// @msgpack/msgpack only.
//
// Connects a DEALER socket to the broker's frontend, sends N requests at once
// ({"id": i, "input": "hello i"} for i = 1..N, plus "model" when given) so that the
// broker can batch them, then reads replies until all N have arrived or the wait
// runs out. Prints one line per reply and a summary line.
//
//   node client.js [-e ENDPOINT] [-n N] [-m MODEL] [-t WAIT_MS] [-T] [-k SERVER_KEY [-s SECRET_KEY]]
//
// -T sends a tensor instead (docs/protocol.md 3.1): FP32 of shape [2] holding i and
// i + 0.5. A tensor in a reply prints in its JSON form, data as numbers.
//
// -k turns CurveZMQ on, for a broker started with --curve-secret-key: SERVER_KEY is
// the broker's public key file (NAME.key from `batcher keygen`), SECRET_KEY this
// client's key pair (NAME.key_secret; without it a throwaway pair, which only a
// broker without --curve-clients admits). Defaults: $BATCHER_CURVE_SERVER_KEY and
// $BATCHER_CURVE_SECRET_KEY, as for `batcher send`.
//
// Exit status: 0 every reply ok, 1 some reply is an error, 2 replies missing after
// WAIT_MS, a request that could not be sent within WAIT_MS (at least 1 s), or a usage
// or socket error.
"use strict";

const fs = require("fs");
const zmq = require("zeromq");
const { encode, decode, ExtData } = require("@msgpack/msgpack");

function usage(message) {
  if (message) console.error(`client: ${message}`);
  console.error(
    "usage: node client.js [-e ENDPOINT] [-n N] [-m MODEL] [-t WAIT_MS] [-T] [-k SERVER_KEY [-s SECRET_KEY]]",
  );
  process.exit(2);
}

function parseArgs(argv) {
  const opts = {
    endpoint: process.env.BATCHER_FRONTEND || "tcp://127.0.0.1:5555",
    n: 3,
    model: null,
    waitMs: 10000,
    serverKey: process.env.BATCHER_CURVE_SERVER_KEY || null,
    secretKey: process.env.BATCHER_CURVE_SECRET_KEY || null,
    tensor: false,
  };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    if (flag === "-T") {
      opts.tensor = true;
      continue;
    }
    const value = argv[i + 1];
    if (!["-e", "-n", "-m", "-t", "-k", "-s"].includes(flag)) usage(`unknown argument ${flag}`);
    if (value === undefined) usage(`${flag} needs a value`);
    i++;
    if (flag === "-e") opts.endpoint = value;
    else if (flag === "-m") opts.model = value;
    else if (flag === "-k") opts.serverKey = value;
    else if (flag === "-s") opts.secretKey = value;
    else if (flag === "-n") {
      opts.n = Number(value);
      if (!Number.isInteger(opts.n) || opts.n < 1 || opts.n > 1000000) {
        usage(`-n wants 1..1000000, got ${value}`);
      }
    } else {
      opts.waitMs = Number(value);
      if (!Number.isInteger(opts.waitMs) || opts.waitMs < 0) {
        usage(`-t wants milliseconds >= 0, got ${value}`);
      }
    }
  }
  return opts;
}

// The 40-character Z85 key in a line `NAME = "..."` of a zmq.auth certificate file
// (NAME is public-key or secret-key).
function readKey(path, name) {
  const match = fs.readFileSync(path, "utf8").match(new RegExp(`^\\s*${name}\\s*=\\s*"(.{40})"`, "m"));
  if (!match) throw new Error(`no ${name} in key file ${path}`);
  return match[1];
}

// A tensor (docs/protocol.md 3.1): its little-endian bytes, viewed in place as a typed
// array when they start at a multiple of the element's size in their buffer (as the
// reference worker aligns them: 3.1, "Alignment"), else read with a DataView.
const TENSOR_READERS = {
  FP32: [4, (view, at) => view.getFloat32(at, true), Float32Array],
  FP64: [8, (view, at) => view.getFloat64(at, true), Float64Array],
  INT32: [4, (view, at) => view.getInt32(at, true), Int32Array],
  INT64: [8, (view, at) => Number(view.getBigInt64(at, true)), BigInt64Array],
  UINT8: [1, (view, at) => view.getUint8(at), Uint8Array],
};

function tensor(values) {
  const data = new Uint8Array(new Float32Array(values).buffer); // a little-endian host assumed
  return { datatype: "FP32", shape: [values.length], data };
}

// A tensor map of a datatype above in JSON form (data as numbers), or null.
function tensorJson(v) {
  if (v === null || typeof v !== "object" || Object.keys(v).length !== 3) return null;
  const reader = TENSOR_READERS[v.datatype];
  if (!reader || !Array.isArray(v.shape) || !(v.data instanceof Uint8Array)) return null;
  const count = v.shape.reduce((a, b) => a * b, 1);
  if (v.data.length !== count * reader[0]) return null;
  const [size, read, Typed] = reader;
  if (v.data.byteOffset % size === 0) {
    // in place, no copy (a little-endian host assumed, as in tensor() above)
    const data = Array.from(new Typed(v.data.buffer, v.data.byteOffset, count), Number);
    return { datatype: v.datatype, shape: v.shape, data };
  }
  const view = new DataView(v.data.buffer, v.data.byteOffset, v.data.byteLength);
  const data = Array.from({ length: count }, (_, i) => read(view, i * size));
  return { datatype: v.datatype, shape: v.shape, data };
}

// Compact JSON, with bin (Uint8Array) as a hex string as the C client prints it, and
// tensors in their JSON form.
function toJson(value) {
  return JSON.stringify(value === undefined ? null : value, (_key, v) => {
    const asTensor = tensorJson(v);
    if (asTensor) return asTensor;
    if (v instanceof Uint8Array) return Buffer.from(v).toString("hex");
    if (v instanceof ExtData) return { ext: v.type, data: Buffer.from(v.data).toString("hex") };
    if (typeof v === "bigint") return v.toString();
    return v;
  });
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const sock = new zmq.Dealer({
    linger: 0,
    sendHighWaterMark: 0,
    sendTimeout: Math.max(1000, opts.waitMs),
  });
  const seen = new Set();
  const tally = { sent: 0, replies: 0, ok: 0, errors: 0 };
  try {
    if (opts.serverKey) {
      // CURVE client options, set before connect (Z85 text).
      sock.curveServerKey = readKey(opts.serverKey, "public-key");
      const pair = opts.secretKey
        ? {
            publicKey: readKey(opts.secretKey, "public-key"),
            secretKey: readKey(opts.secretKey, "secret-key"),
          }
        : zmq.curveKeyPair();
      sock.curvePublicKey = pair.publicKey;
      sock.curveSecretKey = pair.secretKey;
    }
    try {
      sock.connect(opts.endpoint);
    } catch (err) {
      console.error(`client: cannot connect to ${opts.endpoint}: ${err.message}`);
      return 2;
    }

    // Everything in flight at once, so the broker can put them in one batch.
    // DEALER: an empty delimiter frame, then the msgpack body. A send that cannot go
    // out within sendTimeout (no usable connection: for instance a CURVE handshake the
    // broker refused) ends the sending.
    for (let id = 1; id <= opts.n; id++) {
      const request = { id, input: opts.tensor ? tensor([id, id + 0.5]) : `hello ${id}` };
      if (opts.model !== null) request.model = opts.model;
      try {
        await sock.send(["", encode(request)]);
      } catch (err) {
        if (err.code !== "EAGAIN") throw err;
        break;
      }
      tally.sent++;
    }

    const deadline = Date.now() + opts.waitMs;
    while (tally.sent === opts.n && tally.replies < opts.n) {
      const left = deadline - Date.now();
      if (left <= 0) break;
      sock.receiveTimeout = left;
      let frames;
      try {
        frames = await sock.receive();
      } catch (err) {
        if (err.code === "EAGAIN") break; // the wait ran out
        throw err;
      }
      handleReply(frames[frames.length - 1], opts.n, seen, tally); // the body is the last frame
    }

    console.log(
      `summary: sent=${tally.sent} replies=${tally.replies} ok=${tally.ok} errors=${tally.errors}`,
    );
    if (tally.sent < opts.n) {
      console.error(`client: could only send ${tally.sent} of ${opts.n} requests to ${opts.endpoint}`);
      return 2;
    }
    if (tally.replies < opts.n) {
      console.error(
        `client: timeout: ${opts.n - tally.replies} of ${opts.n} replies missing ` +
          `after ${opts.waitMs} ms from ${opts.endpoint}`,
      );
      return 2;
    }
    return tally.errors ? 1 : 0;
  } finally {
    sock.close();
  }
}

function handleReply(body, n, seen, tally) {
  let reply;
  try {
    reply = decode(body);
  } catch (err) {
    console.error(`client: ignored a reply that is not msgpack (${body.length} bytes): ${err.message}`);
    return;
  }
  if (reply === null || typeof reply !== "object" || Array.isArray(reply)) {
    console.error("client: ignored a reply that is not a msgpack map");
    return;
  }
  // Match by id. A nil id is a broker bad_request for a body it could not read: it
  // answers one of our requests, we cannot tell which (docs/protocol.md section 9).
  const id = reply.id === undefined ? null : reply.id;
  if (Number.isInteger(id) && id >= 1 && id <= n) {
    if (seen.has(id)) {
      console.error(`client: ignored a second reply for id ${id}`);
      return;
    }
    seen.add(id);
  } else if (id !== null) {
    console.error("client: ignored a reply with an id we never sent");
    return;
  }
  tally.replies++;

  if (reply.ok === true) {
    let line = `id=${toJson(id)} ok=true output=${toJson(reply.output)}`;
    if (Number.isInteger(reply.batch_size)) line += ` batch_size=${reply.batch_size}`;
    console.log(line);
    tally.ok++;
  } else {
    const error = reply.error || {};
    const code = typeof error.code === "string" ? error.code : "error";
    const message = typeof error.message === "string" ? error.message : "";
    console.log(`id=${toJson(id)} ok=false error=${code} message=${toJson(message)}`);
    tally.errors++;
  }
}

main().then(
  (status) => {
    process.exitCode = status;
  },
  (err) => {
    console.error(`client: ${err.message}`);
    process.exitCode = 2;
  },
);
