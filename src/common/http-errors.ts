import { STATUS_CODES } from 'node:http';
import { BODY_CHARSET, BODY_NOT_UTF8 } from './body-parsers.js';
import { DomainError, ErrorBody, ErrorCode, HTTP_STATUS, errorBody } from './errors.js';

export interface MappedError {
  status: number;
  body: ErrorBody;
  /** true when the error is ours (a bug or unknown failure) and must be logged with its stack. */
  internal: boolean;
}

/** Bad fields an answer lists at most (one for each item of the largest import), with `fieldsOmitted` for the rest. */
export const MAX_LISTED_FIELDS = 10_000;

/** Longest path parameter Fastify's router takes; a longer one is answered through FASTIFY_CODES. */
export const MAX_PARAM_LENGTH = 500;

/**
 * Fastify's own errors, by code: the API's code, the field a VALIDATION_FAILED names, and the reason when
 * Fastify's message is not the one to show. The router's (a path that is not valid percent-encoding, a
 * path parameter over MAX_PARAM_LENGTH) reach mapError through Fastify's `frameworkErrors` option,
 * before any route or hook runs; without it, Fastify answers them with a body of its own (and a 414).
 */
const FASTIFY_CODES: Record<string, { code: ErrorCode; field: string; reason?: string }> = {
  FST_ERR_CTP_BODY_TOO_LARGE: { code: ErrorCode.PAYLOAD_TOO_LARGE, field: 'body', reason: 'request body is too large' },
  FST_ERR_CTP_INVALID_MEDIA_TYPE: { code: ErrorCode.VALIDATION_FAILED, field: 'body' },
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: { code: ErrorCode.VALIDATION_FAILED, field: 'body' },
  FST_ERR_CTP_EMPTY_JSON_BODY: { code: ErrorCode.VALIDATION_FAILED, field: 'body' },
  // Fastify's JSON parser also refuses valid JSON with a key that could set an object's prototype (secure-json-parse),
  // and says only that the body is not valid JSON.
  FST_ERR_CTP_INVALID_JSON_BODY: {
    code: ErrorCode.VALIDATION_FAILED,
    field: 'body',
    reason:
      'the body is not valid JSON, or has a key named "__proto__", or a key "constructor" holding a key "prototype", which are refused',
  },
  // The body parsers' own (src/common/body-parsers.ts): their messages say what is wrong.
  [BODY_NOT_UTF8]: { code: ErrorCode.VALIDATION_FAILED, field: 'body' },
  [BODY_CHARSET]: { code: ErrorCode.VALIDATION_FAILED, field: 'body' },
  FST_ERR_BAD_URL: {
    code: ErrorCode.VALIDATION_FAILED,
    field: 'path',
    reason: 'the path is not a valid URL: a % must start a percent-encoded UTF-8 character',
  },
  FST_ERR_MAX_PARAM_LENGTH: {
    code: ErrorCode.VALIDATION_FAILED,
    field: 'path',
    reason: `a path parameter is longer than ${MAX_PARAM_LENGTH} characters`,
  },
};

/**
 * The raw HTTP answer to a request Node's HTTP parser refused (Fastify's `clientErrorHandler`: an unknown
 * method, a bad Content-Length, headers too large, a request that did not arrive in time), with the API's
 * error body; null when there is no one to answer (the connection was reset).
 */
export function clientErrorResponse(err: { code?: string }): string | null {
  if (err.code === 'ECONNRESET') return null;
  const [status, reason] =
    err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
      ? [408, 'the request did not arrive in time']
      : err.code === 'HPE_HEADER_OVERFLOW'
        ? [431, 'the request headers are too large']
        : [400, 'the request is not well-formed HTTP/1.1'];
  const body = JSON.stringify(errorBody(ErrorCode.VALIDATION_FAILED, reason, { fields: [{ field: 'request', reason }] }));
  return (
    `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\nContent-Type: application/json; charset=utf-8\r\n` +
    `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`
  );
}

/**
 * The details of an answer with the first MAX_LISTED_FIELDS of its bad fields, and how many more there are: a body of
 * hundreds of thousands of unknown fields made an answer of tens of megabytes.
 */
function listedAtMost(details: Record<string, unknown>): Record<string, unknown> {
  const fields = details.fields;
  if (!Array.isArray(fields) || fields.length <= MAX_LISTED_FIELDS) return details;
  const omitted = typeof details.fieldsOmitted === 'number' ? details.fieldsOmitted : 0;
  return { ...details, fields: fields.slice(0, MAX_LISTED_FIELDS), fieldsOmitted: omitted + fields.length - MAX_LISTED_FIELDS };
}

/**
 * Maps anything thrown while serving a request onto the API's error body. Unknown errors become
 * 500 INTERNAL_ERROR with a generic message: nothing internal leaks to the client.
 */
export function mapError(err: unknown): MappedError {
  if (err instanceof DomainError) {
    return { status: err.status, body: errorBody(err.code, err.message, listedAtMost(err.details)), internal: false };
  }
  const e = err as {
    code?: unknown;
    statusCode?: unknown;
    status?: unknown;
    message?: unknown;
    getStatus?: () => number;
    cause?: unknown;
  } | null;
  // Nest's Fastify adapter hands a Fastify error of a request (a body it could not parse) on as an HttpException
  // caused by it.
  const code = typeof e?.code === 'string' ? e.code : (e?.cause as { code?: unknown } | undefined)?.code;
  const fastify = typeof code === 'string' ? FASTIFY_CODES[code] : undefined;
  if (fastify) {
    const message = fastify.reason ?? String(e?.message ?? 'bad request');
    const details = fastify.code === ErrorCode.VALIDATION_FAILED ? { fields: [{ field: fastify.field, reason: message }] } : {};
    return { status: HTTP_STATUS[fastify.code], body: errorBody(fastify.code, message, details), internal: false };
  }
  // Errors Nest or Fastify raise themselves (HttpException, JSON parse errors): keep their 4xx.
  const status = typeof e?.getStatus === 'function' ? e.getStatus() : Number(e?.statusCode ?? e?.status ?? 0);
  if (status === 404) {
    return { status, body: errorBody(ErrorCode.ROUTE_NOT_FOUND, 'no such route'), internal: false };
  }
  if (status === 503) {
    // Terminus' readiness check: keep its per-dependency report.
    const report =
      typeof (e as { getResponse?: () => unknown }).getResponse === 'function' ? (e as { getResponse: () => unknown }).getResponse() : {};
    const failed = Object.keys((report as { error?: Record<string, unknown> } | null)?.error ?? {}).sort();
    return {
      status,
      body: errorBody(
        ErrorCode.DEPENDENCY_UNAVAILABLE,
        failed.length > 0 ? `unavailable: ${failed.join(', ')}` : 'a dependency is unavailable',
        {
          report,
        },
      ),
      internal: false,
    };
  }
  if (status === 413) {
    return { status, body: errorBody(ErrorCode.PAYLOAD_TOO_LARGE, 'request body is too large'), internal: false };
  }
  if (status >= 400 && status < 500) {
    const message = typeof e?.message === 'string' && e.message ? e.message : 'bad request';
    return {
      status: 400,
      body: errorBody(ErrorCode.VALIDATION_FAILED, message, { fields: [{ field: 'body', reason: message }] }),
      internal: false,
    };
  }
  return { status: 500, body: errorBody(ErrorCode.INTERNAL_ERROR, 'internal error'), internal: true };
}
