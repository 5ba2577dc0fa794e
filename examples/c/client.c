/*
 * A batcher client in C, written from docs/protocol.md: libzmq and msgpack-c only.
 *
 * Connects a DEALER socket to the broker's frontend, sends N requests at once
 * ({"id": i, "input": "hello i"} for i = 1..N, plus "model" when given) so that the
 * broker can batch them, then reads replies until all N have arrived or the wait
 * runs out. Prints one line per reply and a summary line.
 *
 *   client [-e ENDPOINT] [-n N] [-m MODEL] [-t WAIT_MS] [-T] [-k SERVER_KEY [-s SECRET_KEY]]
 *
 * -T sends a tensor instead (docs/protocol.md 3.1): FP32 of shape [2] holding i and
 * i + 0.5. A tensor in a reply prints in its JSON form, data as numbers.
 *
 * -k turns CurveZMQ on, for a broker started with --curve-secret-key: SERVER_KEY is
 * the broker's public key file (NAME.key from `batcher keygen`), SECRET_KEY this
 * client's key pair (NAME.key_secret; without it a throwaway pair, which only a
 * broker without --curve-clients admits). Defaults: $BATCHER_CURVE_SERVER_KEY and
 * $BATCHER_CURVE_SECRET_KEY, as for `batcher send`.
 *
 * Exit status: 0 every reply ok, 1 some reply is an error, 2 replies missing after
 * WAIT_MS, a request that could not be sent within WAIT_MS (at least 1 s), or a usage
 * or socket error.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>
#include <zmq.h>

/* --- printing msgpack values as compact JSON (bin as a hex string) ---------------- */

static void print_json_string(const char *p, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c == '\n')
            fputs("\\n", stdout);
        else if (c == '\t')
            fputs("\\t", stdout);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void print_hex_string(const char *p, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++)
        printf("%02x", (unsigned char)p[i]);
    putchar('"');
}

static void print_json(const msgpack_object *o);
static const msgpack_object *map_get(const msgpack_object *map, const char *key);

/* A little-endian element of a tensor's data, as a double. */
static double tensor_element(const char *datatype, const unsigned char *p)
{
    float f32;
    double f64;
    int32_t i32;
    int64_t i64;
    if (strcmp(datatype, "FP32") == 0) {
        memcpy(&f32, p, 4); /* this example assumes a little-endian host */
        return f32;
    }
    if (strcmp(datatype, "FP64") == 0) {
        memcpy(&f64, p, 8);
        return f64;
    }
    if (strcmp(datatype, "INT32") == 0) {
        memcpy(&i32, p, 4);
        return i32;
    }
    if (strcmp(datatype, "INT64") == 0) {
        memcpy(&i64, p, 8);
        return (double)i64;
    }
    return *p; /* UINT8 */
}

/* Print a tensor map ({"datatype", "shape", "data": bin}) of FP32, FP64, INT32, INT64
 * or UINT8 in JSON form, data as numbers; 0 (nothing printed) for anything else. */
static int print_tensor(const msgpack_object *o)
{
    static const struct { const char *name; size_t size; } types[] = {
        {"FP32", 4}, {"FP64", 8}, {"INT32", 4}, {"INT64", 8}, {"UINT8", 1}};
    const msgpack_object *datatype = map_get(o, "datatype");
    const msgpack_object *shape = map_get(o, "shape");
    const msgpack_object *data = map_get(o, "data");
    char name[8];
    size_t size = 0, count = 1;

    if (o->via.map.size != 3 || !datatype || datatype->type != MSGPACK_OBJECT_STR ||
        datatype->via.str.size >= sizeof name || !shape || shape->type != MSGPACK_OBJECT_ARRAY ||
        !data || data->type != MSGPACK_OBJECT_BIN)
        return 0;
    memcpy(name, datatype->via.str.ptr, datatype->via.str.size);
    name[datatype->via.str.size] = '\0';
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (strcmp(name, types[i].name) == 0)
            size = types[i].size;
    for (uint32_t i = 0; i < shape->via.array.size; i++) {
        if (shape->via.array.ptr[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return 0;
        count *= (size_t)shape->via.array.ptr[i].via.u64;
    }
    if (!size || data->via.bin.size != count * size)
        return 0;
    printf("{\"datatype\":\"%s\",\"shape\":", name);
    print_json(shape);
    fputs(",\"data\":[", stdout);
    for (size_t i = 0; i < count; i++)
        printf("%s%.9g", i ? "," : "", tensor_element(name, (const unsigned char *)data->via.bin.ptr + i * size));
    fputs("]}", stdout);
    return 1;
}

static void print_json(const msgpack_object *o)
{
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
        fputs("null", stdout);
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        fputs(o->via.boolean ? "true" : "false", stdout);
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        printf("%" PRIu64, o->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        printf("%" PRId64, o->via.i64);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (isfinite(o->via.f64))
            printf("%.15g", o->via.f64);
        else
            fputs("null", stdout); /* as JSON.stringify does */
        break;
    case MSGPACK_OBJECT_STR:
        print_json_string(o->via.str.ptr, o->via.str.size);
        break;
    case MSGPACK_OBJECT_BIN:
        print_hex_string(o->via.bin.ptr, o->via.bin.size);
        break;
    case MSGPACK_OBJECT_ARRAY:
        putchar('[');
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            if (i)
                putchar(',');
            print_json(&o->via.array.ptr[i]);
        }
        putchar(']');
        break;
    case MSGPACK_OBJECT_MAP:
        if (print_tensor(o))
            break;
        putchar('{');
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            const msgpack_object_kv *kv = &o->via.map.ptr[i];
            if (i)
                putchar(',');
            if (kv->key.type == MSGPACK_OBJECT_STR) {
                print_json(&kv->key);
            } else { /* JSON keys are strings: quote the key's JSON form */
                putchar('"');
                print_json(&kv->key);
                putchar('"');
            }
            putchar(':');
            print_json(&kv->val);
        }
        putchar('}');
        break;
    case MSGPACK_OBJECT_EXT:
        printf("{\"ext\":%d,\"data\":", (int)o->via.ext.type);
        print_hex_string(o->via.ext.ptr, o->via.ext.size);
        putchar('}');
        break;
    default:
        fputs("null", stdout);
    }
}

/* --- request and reply ----------------------------------------------------------- */

/* The value of a str key in a msgpack map, or NULL. */
static const msgpack_object *map_get(const msgpack_object *map, const char *key)
{
    size_t klen = strlen(key);
    if (map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == klen &&
            memcmp(k->via.str.ptr, key, klen) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

static void pack_cstr(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* Send [""][{"id": id, "input": "hello <id>", "model": model}], or with -T the input
 * {"datatype": "FP32", "shape": [2], "data": <id, id + 0.5 as little-endian floats>};
 * 0 on success. */
static int send_request(void *sock, int id, const char *model, int tensor)
{
    char input[32];
    msgpack_sbuffer buf;
    msgpack_packer pk;
    int rc = 0;

    snprintf(input, sizeof input, "hello %d", id);
    msgpack_sbuffer_init(&buf);
    msgpack_packer_init(&pk, &buf, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, model ? 3 : 2);
    pack_cstr(&pk, "id");
    msgpack_pack_int(&pk, id);
    pack_cstr(&pk, "input");
    if (tensor) {
        float values[2] = {(float)id, (float)id + 0.5f}; /* a little-endian host assumed */
        msgpack_pack_map(&pk, 3);
        pack_cstr(&pk, "datatype");
        pack_cstr(&pk, "FP32");
        pack_cstr(&pk, "shape");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_int(&pk, 2);
        pack_cstr(&pk, "data");
        msgpack_pack_bin(&pk, sizeof values);
        msgpack_pack_bin_body(&pk, values, sizeof values);
    } else {
        pack_cstr(&pk, input);
    }
    if (model) {
        pack_cstr(&pk, "model");
        pack_cstr(&pk, model);
    }
    /* DEALER: an empty delimiter frame, then the body frame. */
    if (zmq_send(sock, "", 0, ZMQ_SNDMORE) < 0 || zmq_send(sock, buf.data, buf.size, 0) < 0) {
        fprintf(stderr, "client: send failed: %s\n", zmq_strerror(zmq_errno()));
        rc = -1;
    }
    msgpack_sbuffer_destroy(&buf);
    return rc;
}

struct tally {
    int n;             /* requests to send, ids 1..n */
    int sent;          /* requests sent */
    char *seen;        /* seen[id] = 1 once its reply arrived */
    int replies, ok, errors;
};

/* Decode one reply body, print its line and count it. */
static void handle_reply(const char *data, size_t size, struct tally *t)
{
    msgpack_unpacked result;
    size_t off = 0;

    msgpack_unpacked_init(&result);
    if (msgpack_unpack_next(&result, data, size, &off) != MSGPACK_UNPACK_SUCCESS ||
        result.data.type != MSGPACK_OBJECT_MAP) {
        fprintf(stderr, "client: ignored a reply that is not a msgpack map (%zu bytes)\n", size);
        msgpack_unpacked_destroy(&result);
        return;
    }
    const msgpack_object *reply = &result.data;
    const msgpack_object *id = map_get(reply, "id");
    const msgpack_object *ok = map_get(reply, "ok");

    /* Match by id. A nil id is a broker bad_request for a body it could not read:
     * it answers one of our requests, we cannot tell which (docs/protocol.md 9). */
    if (id && id->type == MSGPACK_OBJECT_POSITIVE_INTEGER && id->via.u64 >= 1 &&
        id->via.u64 <= (uint64_t)t->n) {
        if (t->seen[id->via.u64]) {
            fprintf(stderr, "client: ignored a second reply for id %" PRIu64 "\n", id->via.u64);
            msgpack_unpacked_destroy(&result);
            return;
        }
        t->seen[id->via.u64] = 1;
    } else if (id && id->type != MSGPACK_OBJECT_NIL) {
        fprintf(stderr, "client: ignored a reply with an id we never sent\n");
        msgpack_unpacked_destroy(&result);
        return;
    }
    t->replies++;

    fputs("id=", stdout);
    if (id)
        print_json(id);
    else
        fputs("null", stdout);
    if (ok && ok->type == MSGPACK_OBJECT_BOOLEAN && ok->via.boolean) {
        const msgpack_object *output = map_get(reply, "output");
        const msgpack_object *batch_size = map_get(reply, "batch_size");
        fputs(" ok=true output=", stdout);
        if (output)
            print_json(output);
        else
            fputs("null", stdout);
        if (batch_size && batch_size->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
            printf(" batch_size=%" PRIu64, batch_size->via.u64);
        t->ok++;
    } else {
        const msgpack_object *error = map_get(reply, "error");
        const msgpack_object *code = error ? map_get(error, "code") : NULL;
        const msgpack_object *message = error ? map_get(error, "message") : NULL;
        fputs(" ok=false error=", stdout);
        if (code && code->type == MSGPACK_OBJECT_STR)
            fwrite(code->via.str.ptr, 1, code->via.str.size, stdout);
        else
            fputs("error", stdout);
        fputs(" message=", stdout);
        if (message && message->type == MSGPACK_OBJECT_STR)
            print_json(message);
        else
            fputs("\"\"", stdout);
        t->errors++;
    }
    putchar('\n');
    fflush(stdout);
    msgpack_unpacked_destroy(&result);
}

/* Receive one whole multipart message and hand its last frame (the body) on. */
static int receive_one(void *sock, struct tally *t)
{
    zmq_msg_t part;
    char *body = NULL;
    size_t body_size = 0;
    int more;

    do {
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, sock, 0) < 0) {
            fprintf(stderr, "client: receive failed: %s\n", zmq_strerror(zmq_errno()));
            zmq_msg_close(&part);
            free(body);
            return -1;
        }
        more = zmq_msg_more(&part);
        free(body); /* keep only the last frame */
        body_size = zmq_msg_size(&part);
        body = malloc(body_size ? body_size : 1);
        if (!body) {
            zmq_msg_close(&part);
            return -1;
        }
        memcpy(body, zmq_msg_data(&part), body_size);
        zmq_msg_close(&part);
    } while (more);
    handle_reply(body, body_size, t);
    free(body);
    return 0;
}

/* The 40-character Z85 key in a line `NAME = "..."` of a zmq.auth certificate file
 * (NAME is public-key or secret-key); 0 on success. */
static int read_key(const char *path, const char *name, char out[41])
{
    FILE *f = fopen(path, "r");
    char line[512];
    size_t nlen = strlen(name);

    if (!f) {
        fprintf(stderr, "client: cannot open key file %s\n", path);
        return -1;
    }
    while (fgets(line, sizeof line, f)) {
        char *p = line, *end;
        while (*p == ' ' || *p == '\t')
            p++;
        if (strncmp(p, name, nlen) != 0)
            continue;
        p += nlen;
        while (*p == ' ' || *p == '\t' || *p == '=')
            p++;
        if (*p++ != '"' || !(end = strchr(p, '"')) || end - p != 40)
            continue;
        memcpy(out, p, 40);
        out[40] = '\0';
        fclose(f);
        return 0;
    }
    fclose(f);
    fprintf(stderr, "client: no %s in key file %s\n", name, path);
    return -1;
}

/* CURVE client options, set before connect; 0 on success. */
static int set_curve(void *sock, const char *server_key_file, const char *secret_key_file)
{
    char server[41], public[41], secret[41];

    if (read_key(server_key_file, "public-key", server) != 0)
        return -1;
    if (secret_key_file && *secret_key_file) {
        if (read_key(secret_key_file, "public-key", public) != 0 ||
            read_key(secret_key_file, "secret-key", secret) != 0)
            return -1;
    } else if (zmq_curve_keypair(public, secret) != 0) {
        fprintf(stderr, "client: no CURVE support: %s\n", zmq_strerror(zmq_errno()));
        return -1;
    }
    /* Z85 text with its terminating NUL: 41 bytes (32 raw bytes would do as well). */
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server, 41) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, public, 41) != 0 ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, secret, 41) != 0) {
        fprintf(stderr, "client: cannot set CURVE keys: %s\n", zmq_strerror(zmq_errno()));
        return -1;
    }
    return 0;
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void usage(void)
{
    fprintf(stderr, "usage: client [-e ENDPOINT] [-n N] [-m MODEL] [-t WAIT_MS] [-T]"
                    " [-k SERVER_KEY [-s SECRET_KEY]]\n");
}

int main(int argc, char **argv)
{
    const char *endpoint = getenv("BATCHER_FRONTEND");
    const char *model = NULL;
    const char *server_key = getenv("BATCHER_CURVE_SERVER_KEY");
    const char *secret_key = getenv("BATCHER_CURVE_SECRET_KEY");
    long n = 3, wait_ms = 10000;
    int tensor = 0;
    int opt;

    if (!endpoint || !*endpoint)
        endpoint = "tcp://127.0.0.1:5555";
    while ((opt = getopt(argc, argv, "e:n:m:t:k:s:Th")) != -1) {
        char *end = NULL;
        switch (opt) {
        case 'T':
            tensor = 1;
            break;
        case 'e':
            endpoint = optarg;
            break;
        case 'm':
            model = optarg;
            break;
        case 'k':
            server_key = optarg;
            break;
        case 's':
            secret_key = optarg;
            break;
        case 'n':
            n = strtol(optarg, &end, 10);
            if (*end || n < 1 || n > 1000000) {
                fprintf(stderr, "client: -n wants 1..1000000, got %s\n", optarg);
                return 2;
            }
            break;
        case 't':
            wait_ms = strtol(optarg, &end, 10);
            if (*end || wait_ms < 0) {
                fprintf(stderr, "client: -t wants milliseconds >= 0, got %s\n", optarg);
                return 2;
            }
            break;
        default:
            usage();
            return 2;
        }
    }
    if (optind != argc) {
        usage();
        return 2;
    }

    struct tally t = {.n = (int)n, .seen = calloc((size_t)n + 1, 1)};
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0, send_timeout = (int)(wait_ms < 1000 ? 1000 : wait_ms);
    int status = 2;

    if (!t.seen || !ctx || !sock)
        return 2;
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(sock, ZMQ_SNDHWM, &zero, sizeof zero); /* all N requests queue */
    zmq_setsockopt(sock, ZMQ_SNDTIMEO, &send_timeout, sizeof send_timeout);
    if (server_key && *server_key && set_curve(sock, server_key, secret_key) != 0)
        goto done;
    if (zmq_connect(sock, endpoint) != 0) {
        fprintf(stderr, "client: cannot connect to %s: %s\n", endpoint, zmq_strerror(zmq_errno()));
        goto done;
    }

    /* Everything in flight at once, so the broker can put them in one batch. A send
     * that cannot go out within ZMQ_SNDTIMEO (no usable connection: for instance a
     * CURVE handshake the broker refused) ends the sending. */
    while (t.sent < t.n && send_request(sock, t.sent + 1, model, tensor) == 0)
        t.sent++;

    int64_t deadline = now_ms() + wait_ms;
    while (t.sent == t.n && t.replies < t.n) {
        int64_t left = deadline - now_ms();
        if (left <= 0)
            break;
        zmq_pollitem_t item = {.socket = sock, .events = ZMQ_POLLIN};
        int rc = zmq_poll(&item, 1, (long)left);
        if (rc < 0) {
            fprintf(stderr, "client: poll failed: %s\n", zmq_strerror(zmq_errno()));
            goto done;
        }
        if (rc > 0 && receive_one(sock, &t) != 0)
            goto done;
    }

    printf("summary: sent=%d replies=%d ok=%d errors=%d\n", t.sent, t.replies, t.ok, t.errors);
    if (t.sent < t.n) {
        fprintf(stderr, "client: could only send %d of %d requests to %s\n", t.sent, t.n, endpoint);
        status = 2;
    } else if (t.replies < t.n) {
        fprintf(stderr, "client: timeout: %d of %d replies missing after %ld ms from %s\n",
                t.n - t.replies, t.n, wait_ms, endpoint);
        status = 2;
    } else {
        status = t.errors ? 1 : 0;
    }

done:
    zmq_close(sock);
    zmq_ctx_term(ctx);
    free(t.seen);
    return status;
}
