import 'reflect-metadata';
import { NestFactory } from '@nestjs/core';
import { FastifyAdapter, NestFastifyApplication } from '@nestjs/platform-fastify';
import { DocumentBuilder, SwaggerModule } from '@nestjs/swagger';
import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify';
import { randomUUID } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import type { Redis } from 'ioredis';
import { AppModule } from './app.module.js';
import { API_KEY_SCHEME, RouteRoles, authorize, parseApiKeys } from './common/auth.js';
import { installBodyParsers } from './common/body-parsers.js';
import { createValidationPipe, hasOwnKey, linkableBody, linkRequestParts } from './common/validation.js';
import { addValidationLimits } from './common/openapi-limits.js';
import { addTransportResponses } from './common/api-errors.decorator.js';
import { createPino, PinoLoggerService } from './common/logger.js';
import { DomainError, ErrorCode, FieldError } from './common/errors.js';
import { MAX_PARAM_LENGTH, clientErrorResponse, mapError } from './common/http-errors.js';
import { RateLimiter } from './common/rate-limiter.js';
import { AppConfig, expiryBudgetWarning, trustProxyOption } from './config/app-config.js';
import { runMigrations } from './database/migrate.js';
import { unreachable } from './common/dependency-errors.js';
import { MetricsService } from './metrics/metrics.service.js';
import { RESERVE_ROUTE } from './reservations/reservations.controller.js';
import { idempotencyKeyFault } from './reservations/reservations.service.js';
import { REDIS, assertUsableRedis } from './redis/redis.client.js';

export const API_VERSION = '1';

declare module 'fastify' {
  interface FastifyRequest {
    /** When this instance took the request up (Date.now(), its own clock): the first thing every request does. */
    receivedAtMs: number;
    /** The parameters of its query string, which no call of the API takes: refused with its path's and body's faults. */
    queryFaults: FieldError[] | null;
  }
}

const REQUEST_ID = /^[\w.:-]{1,128}$/;
/**
 * Connections Node's HTTP parser refused and clientErrorHandler answered itself, with the status it wrote (a 408 for a
 * body that did not arrive in time): a request of theirs is not one its client abandoned (see `abandoned`).
 */
const answeredOnSocket = new WeakMap<object, number>();
/** How long a request's headers may take to arrive at most (Node's default); REQUEST_TIMEOUT_MS if shorter. */
const HEADERS_TIMEOUT_MS = 60_000;

/** A caller's x-request-id when it is sane, else a new UUID. */
export function requestId(req: IncomingMessage): string {
  const given = req.headers['x-request-id'];
  return typeof given === 'string' && REQUEST_ID.test(given) ? given : randomUUID();
}

/** Builds the OpenAPI document from the controllers and DTOs. */
export function buildOpenApi(app: NestFastifyApplication) {
  const config = new DocumentBuilder()
    .setTitle('respool')
    .setDescription(
      'Resource-pool reservation service: items are held for a caller with a Redis TTL hold and committed with a ' +
        'version-checked Postgres update. Every error answer has the body `{ "error": { "code", "message", "details" } }`. ' +
        'Every string in a request body, at any depth (attribute keys too), must be well-formed Unicode text without the ' +
        'NUL character (`\\u0000`; JSON escapes `\\ud800`-`\\udfff` only as a surrogate pair): Postgres cannot store it ' +
        'otherwise, and it is refused with 400 VALIDATION_FAILED naming the field. Lengths count Unicode code points.',
    )
    .setVersion(API_VERSION)
    // Checked only when the deployment sets API_KEYS; either header will do.
    .addBearerAuth({ type: 'http', scheme: 'bearer', bearerFormat: 'API key', description: 'An API key of API_KEYS' })
    .addApiKey({ type: 'apiKey', in: 'header', name: 'X-API-Key', description: 'An API key of API_KEYS' }, API_KEY_SCHEME)
    .build();
  return addTransportResponses(addValidationLimits(SwaggerModule.createDocument(app, config)));
}

/**
 * Creates the whole service: database created and migrated, Redis checked, HTTP app with validation,
 * error mapping, metrics, docs. `listen` is left to the caller.
 */
export async function createApp(config: AppConfig, options: { logger?: boolean } = {}): Promise<NestFastifyApplication> {
  const log = createPino(config.LOG_LEVEL);
  const quiet = options.logger === false;
  const applied = await runMigrations(config, (message) => quiet || log.warn({ context: 'Migrations' }, `postgres: ${message}`));
  if (applied.length > 0 && !quiet) log.info({ context: 'Migrations', applied }, `applied migrations: ${applied.join(', ')}`);
  const adapter = new FastifyAdapter({
    // The request id of the request's log lines; echoed in x-request-id.
    genReqId: requestId,
    // Whose X-Forwarded-For is believed: the client's address (req.ip) the rate limit counts by.
    trustProxy: trustProxyOption(config.TRUST_PROXY),
    bodyLimit: config.BODY_LIMIT_BYTES,
    // A request that arrives too slowly is answered 408 (clientErrorHandler) and its connection closed: Fastify's
    // default (0) would let a body that stalls hold its connection for ever. Node checks every second, not every 30.
    requestTimeout: config.REQUEST_TIMEOUT_MS,
    http: {
      requestTimeout: config.REQUEST_TIMEOUT_MS,
      headersTimeout: Math.min(HEADERS_TIMEOUT_MS, config.REQUEST_TIMEOUT_MS),
      connectionsCheckingInterval: 1000,
    },
    // Requests that arrive while the instance shuts down are answered by the hook below, with the API's body.
    return503OnClosing: false,
    forceCloseConnections: 'idle',
    // Errors raised before any route or hook runs answer with the API's error body too.
    routerOptions: { maxParamLength: MAX_PARAM_LENGTH },
    frameworkErrors: (err: FastifyError, req: FastifyRequest, reply: FastifyReply) => {
      const mapped = mapError(err);
      void reply.status(mapped.status).header('x-request-id', req.id).send(mapped.body);
    },
    clientErrorHandler: (err: NodeJS.ErrnoException, socket) => {
      if (socket.destroyed) return;
      const answer = clientErrorResponse(err);
      if (answer !== null && socket.writable) {
        socket.write(answer);
        answeredOnSocket.set(socket, Number(answer.slice('HTTP/1.1 '.length, 'HTTP/1.1 '.length + 3)));
      }
      socket.destroy(err);
    },
  });
  const expiryWarning = expiryBudgetWarning(config);
  if (expiryWarning && !quiet) log.warn(expiryWarning);
  const app = await NestFactory.create<NestFastifyApplication>(AppModule.forRoot(config), adapter, {
    logger: quiet ? false : new PinoLoggerService(log),
    abortOnError: false,
    // JSON only (installBodyParsers, below). Nest's defaults add form bodies, which a cross-site HTML form can send
    // without a CORS check; API.md takes JSON alone.
    bodyParser: false,
  });
  try {
    const redis = app.get<Redis>(REDIS);
    const redisUrl = new URL(config.REDIS_URL);
    // connect() fails with "Connection is closed."; the socket's own error (refused, unknown host) came first.
    let cause: unknown;
    const keepCause = (err: unknown) => (cause ??= err);
    redis.on('error', keepCause);
    await redis
      .connect()
      .catch((err: unknown) => Promise.reject(unreachable('Redis', redisUrl, 6379, cause ?? err)))
      .finally(() => redis.off('error', keepCause));
    await assertUsableRedis(redis, redisUrl, config.REDIS_TIMEOUT_MS);
  } catch (err) {
    await app.close().catch(() => undefined);
    throw err;
  }

  app.useGlobalPipes(createValidationPipe());
  // The callers of API keys (role, bound owner), by the key's digest; none: every call is open.
  const apiKeys = config.API_KEYS === '' ? undefined : parseApiKeys(config.API_KEYS).keys;

  const fastify = app.getHttpAdapter().getInstance();
  installBodyParsers(fastify);
  const metrics = app.get(MetricsService);
  fastify.decorateRequest('receivedAtMs', 0);
  fastify.decorateRequest('actingFor', null);
  fastify.decorateRequest('queryFaults', null);
  // Shutting down (SIGTERM, closeGracefully): what arrives now, on a connection still open, is refused at once with the
  // API's error body; Fastify adds `Connection: close`, so the client's next request goes to another instance. Every
  // answer sent from now on says `Connection: close` too (onSend, below), the answers of requests in flight included: a
  // client told to keep the connection would send its next request on it as the close cuts it, and see a reset.
  let closing = false;
  startClosing.set(app, () => (closing = true));
  fastify.addHook('preClose', async () => {
    closing = true;
  });
  // A callback hook: no promise on the hot path.
  fastify.addHook('onSend', (_req: FastifyRequest, reply: FastifyReply, payload: unknown, done: (err: null, payload: unknown) => void) => {
    if (closing) void reply.header('connection', 'close');
    done(null, payload);
  });
  // Per client address, before the key is checked: guesses at API keys count too.
  const limiter =
    config.RATE_LIMIT_PER_SECOND > 0
      ? new RateLimiter(config.RATE_LIMIT_PER_SECOND, config.RATE_LIMIT_BURST || config.RATE_LIMIT_PER_SECOND)
      : undefined;
  const logRequests = config.LOG_REQUESTS === 'true' && !quiet;
  /** A request's metric, and its log line (LOG_REQUESTS). */
  const answered = (req: FastifyRequest, status: number, ms: number, line = 'request completed') => {
    metrics.httpDuration.observe({ method: req.method, route: req.routeOptions.url ?? 'unmatched', status: String(status) }, ms / 1000);
    if (logRequests) {
      log.info(
        { reqId: req.id, req: { method: req.method, url: req.url, remoteAddress: req.ip }, res: { statusCode: status }, responseTime: ms },
        line,
      );
    }
  };
  /**
   * A request whose client went away before its answer (a timeout, a hang-up): no answer is sent, so onResponse never
   * runs. Counted (and logged) as nginx does, status 499: during an outage these are the requests that fail. Unless
   * it was answered beside Fastify (a 408 by clientErrorHandler): counted with that status. (Fastify's onRequestAbort
   * hook fires only for a request whose body had not all arrived.)
   */
  const abandoned = (req: FastifyRequest, socket: object | null) => {
    const ms = Math.max(0, Date.now() - req.receivedAtMs);
    const status = socket === null ? undefined : answeredOnSocket.get(socket);
    if (status !== undefined) answered(req, status, ms);
    else answered(req, 499, ms, 'request abandoned: the client went away before its answer');
  };
  // One hook for every request (each hook costs the hot path a promise), its first step.
  fastify.addHook('onRequest', async (req: FastifyRequest, reply: FastifyReply) => {
    req.receivedAtMs = Date.now();
    void reply.header('x-request-id', req.id);
    const socket = req.raw.socket;
    // The client's address, read while the connection is open (Node keeps it): an abandoned request's line has it too.
    if (logRequests) void socket.remoteAddress;
    reply.raw.once('close', () => {
      if (!reply.raw.writableFinished) abandoned(req, socket);
    });
    // A request with no body is one without a body, whatever its Content-Type says: clients that send
    // `Content-Type: application/json` on every call (a DELETE, a complete) would otherwise meet the JSON
    // parser's refusal of an empty body.
    const headers = req.headers;
    if (
      headers['content-type'] !== undefined &&
      headers['transfer-encoding'] === undefined &&
      (headers['content-length'] === undefined || headers['content-length'] === '0')
    )
      delete headers['content-type'];
    let refused: DomainError | undefined;
    if (closing) refused = DomainError.shuttingDown();
    else if (limiter !== undefined && !req.url.startsWith('/health') && !req.url.startsWith('/metrics') && !limiter.take(req.ip)) {
      refused = DomainError.rateLimited(config.RATE_LIMIT_PER_SECOND);
    }
    // A path no route serves (or a method it does not take) is answered before its body is read: a body that is not JSON
    // was answered 400, and the same request without one 404.
    else if (req.is404) refused = new DomainError(ErrorCode.ROUTE_NOT_FOUND, 'no such route');
    // The key is checked before the body is read: a caller without one learns nothing and costs little.
    else if (apiKeys !== undefined) {
      const caller = authorize(apiKeys, req.routeOptions.config as RouteRoles, headers);
      if (caller instanceof DomainError) refused = caller;
      else req.actingFor = caller?.owner ?? null;
    }
    if (refused === undefined && req.url.includes('?') && req.url.startsWith('/v1/')) {
      // No call of the API takes a query string (API.md): a field in one is refused like any unknown field.
      const fields = Object.keys(req.query as object);
      if (fields.length > 0) {
        const faults = fields.map((field) => ({ field, reason: `query parameter ${field} is not accepted` }));
        // Listed with the path's and the body's bad fields by their pipes (linkRequestParts), on a route that has either;
        // refused here on one that has neither (the pool list).
        if (req.method === 'POST' || (typeof req.params === 'object' && req.params !== null && hasOwnKey(req.params)))
          req.queryFaults = faults;
        else refused = DomainError.validation(faults);
      }
    }
    if (refused) {
      const mapped = mapError(refused);
      // RFC 9110: a 401 names the scheme that would be accepted.
      if (refused.code === ErrorCode.UNAUTHENTICATED) reply.header('www-authenticate', 'Bearer realm="respool"');
      if (refused.code === ErrorCode.RATE_LIMITED) reply.header('retry-after', '1');
      await reply.status(mapped.status).send(mapped.body);
    }
  });
  // Once the body is read: the path parameters and the body are validated apart, by one pipe each; linked, a request
  // bad in both is refused listing the bad fields of both (API.md: `details.fields` lists each bad field). A body that
  // is not an object is put in one to be linked (linkableBody). A callback hook: no promise on the hot path.
  fastify.addHook('preHandler', (req: FastifyRequest, _reply: FastifyReply, done: () => void) => {
    req.body = linkableBody(req.body);
    // A query string, and a bad Idempotency-Key of a reserve, are listed with the path's and the body's bad fields.
    const badKey =
      req.method === 'POST' && req.routeOptions.url === RESERVE_ROUTE ? idempotencyKeyFault(req.headers['idempotency-key']) : null;
    const pending = badKey ? [...(req.queryFaults ?? []), badKey] : req.queryFaults;
    linkRequestParts(req.params, req.body, pending ?? undefined);
    done();
  });
  fastify.addHook('onResponse', async (req: FastifyRequest, reply: FastifyReply) => {
    // Answered before its body arrived whole (refused in onRequest, or a GET whose body Fastify ignores): the
    // connection is closed, so that no 408 is written after this answer once REQUEST_TIMEOUT_MS passes, which a
    // client reusing the connection would take for the answer to its next request.
    // (Its line first: a destroyed socket no longer tells the client's address.)
    answered(req, reply.statusCode, reply.elapsedTime);
    if (!req.raw.complete) req.raw.socket?.destroy();
  });
  const document = buildOpenApi(app);
  SwaggerModule.setup('docs', app, document, { jsonDocumentUrl: 'docs-json' });
  await app.init();
  return app;
}

/** Per app: marks it closing (see createApp), before app.close() does. */
const startClosing = new WeakMap<NestFastifyApplication, () => void>();

/**
 * How long a closing instance keeps its open connections before it closes those that are idle: a client whose
 * request is on its way on one (sent just before its last answer, which said keep-alive, arrived) is answered `503`
 * and `Connection: close` instead of meeting a reset, which would leave it not knowing whether the call took effect.
 */
export const SHUTDOWN_DRAIN_MS = 250;

/**
 * Closes the app gracefully: every answer from now on closes its connection (requests that arrive are refused with
 * 503) and, for SHUTDOWN_DRAIN_MS while any connection is open, requests on their way still get that answer; then no
 * new connections, the requests in flight answered, and Nest's shutdown hooks. A keep-alive connection whose last
 * request ends while the app closes (a reserve that was waiting, answered 503) would hold the server open until its
 * idle timeout: each is closed as soon as it is idle.
 */
export async function closeGracefully(app: NestFastifyApplication, drainMs = SHUTDOWN_DRAIN_MS): Promise<void> {
  const server = app.getHttpServer();
  startClosing.get(app)?.();
  const open = await new Promise<number>((resolve) => server.getConnections((err, n) => resolve(err ? 1 : n)));
  if (open > 0 && drainMs > 0) await new Promise((resolve) => setTimeout(resolve, drainMs));
  const idle = setInterval(() => server.closeIdleConnections(), 50);
  idle.unref();
  try {
    await app.close();
  } finally {
    clearInterval(idle);
  }
}
