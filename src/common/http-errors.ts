import { DomainError, ErrorBody, ErrorCode, HTTP_STATUS, errorBody } from './errors.js';

export interface MappedError {
  status: number;
  body: ErrorBody;
  /** true when the error is ours (a bug or unknown failure) and must be logged with its stack. */
  internal: boolean;
}

const FASTIFY_CODES: Record<string, ErrorCode> = {
  FST_ERR_CTP_BODY_TOO_LARGE: ErrorCode.PAYLOAD_TOO_LARGE,
  FST_ERR_CTP_INVALID_MEDIA_TYPE: ErrorCode.VALIDATION_FAILED,
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: ErrorCode.VALIDATION_FAILED,
  FST_ERR_CTP_EMPTY_JSON_BODY: ErrorCode.VALIDATION_FAILED,
  FST_ERR_CTP_INVALID_JSON_BODY: ErrorCode.VALIDATION_FAILED,
};

/**
 * Maps anything thrown while serving a request onto the API's error body. Unknown errors become
 * 500 INTERNAL_ERROR with a generic message: nothing internal leaks to the client.
 */
export function mapError(err: unknown): MappedError {
  if (err instanceof DomainError) {
    return { status: err.status, body: errorBody(err.code, err.message, err.details), internal: false };
  }
  const e = err as { code?: unknown; statusCode?: unknown; status?: unknown; message?: unknown; getStatus?: () => number } | null;
  const fastifyCode = typeof e?.code === 'string' ? FASTIFY_CODES[e.code] : undefined;
  if (fastifyCode) {
    const message = fastifyCode === ErrorCode.PAYLOAD_TOO_LARGE ? 'request body is too large' : String(e?.message ?? 'bad request');
    const details = fastifyCode === ErrorCode.VALIDATION_FAILED ? { fields: [{ field: 'body', reason: message }] } : {};
    return { status: HTTP_STATUS[fastifyCode], body: errorBody(fastifyCode, message, details), internal: false };
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
    return {
      status,
      body: errorBody(ErrorCode.DEPENDENCY_UNAVAILABLE, 'a dependency is unavailable', { report }),
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
