import { isAscii, isUtf8 } from 'node:buffer';
import type { Readable } from 'node:stream';
import { errorCodes, type FastifyInstance, type FastifyRequest } from 'fastify';

/** The codes of the refusals below, which mapError answers `400 VALIDATION_FAILED` naming `body` (FASTIFY_CODES). */
export const BODY_NOT_UTF8 = 'RESPOOL_BODY_NOT_UTF8';
export const BODY_CHARSET = 'RESPOOL_BODY_CHARSET';

/** The charset parameter of a Content-Type, if it has one. */
const CHARSET = /;\s*charset\s*=\s*"?([^";\s]*)/i;

function refusal(code: string, message: string): Error {
  return Object.assign(new Error(message), { code, statusCode: 400 });
}

/** The charsets a JSON body may be declared in: UTF-8 (RFC 8259: JSON is sent in it) and its subset US-ASCII. */
const JSON_CHARSETS = new Set(['utf-8', 'utf8', 'us-ascii']);

/**
 * The body parsers: Fastify's JSON parser, given the body's bytes only once they are known to be UTF-8, and a parser
 * of every other media type that takes an empty body for none (so do the JSON and the text parser).
 *
 * Fastify decodes a JSON body with replacement characters: two values that differ only in bytes that are not UTF-8
 * were stored as one (the second counted a duplicate), and a body declared `charset=iso-8859-1` was read as UTF-8.
 * Both are now refused and change nothing.
 *
 * A request without Content-Type that has a body goes to the parser of every other type, as does a type no parser
 * takes: a chunked request whose body is empty (a DELETE sent by a client that streams every body) is one without a
 * body, as one with `Content-Length: 0` is (the onRequest hook); any byte of a body is refused at once, as Fastify
 * refuses such a media type.
 */
export function installBodyParsers(fastify: FastifyInstance): void {
  const parseJson = fastify.getDefaultJsonParser('error', 'error');
  fastify.removeContentTypeParser('application/json');
  // No DTO takes text: a text body is refused by validation, naming the body with the path's faults; an empty one is none.
  fastify.removeContentTypeParser('text/plain');
  fastify.addContentTypeParser('text/plain', { parseAs: 'string' }, (_req, body: string, done) =>
    done(null, body.length === 0 ? undefined : body),
  );
  fastify.addContentTypeParser('application/json', { parseAs: 'buffer' }, (req, body: Buffer, done) => {
    const charset = CHARSET.exec(req.headers['content-type'] ?? '')?.[1];
    const name = charset?.toLowerCase();
    if (body.length === 0) {
      done(null, undefined);
    } else if (name !== undefined && !JSON_CHARSETS.has(name)) {
      done(refusal(BODY_CHARSET, `the body must be JSON in UTF-8; charset ${JSON.stringify(charset)} is not accepted`), undefined);
    } else if (!isUtf8(body)) {
      done(refusal(BODY_NOT_UTF8, 'the body is not valid UTF-8'), undefined);
    } else if (name === 'us-ascii' && !isAscii(body)) {
      done(refusal(BODY_NOT_UTF8, 'the body is not US-ASCII, which its Content-Type says it is'), undefined);
    } else {
      void parseJson(req, body.toString('utf8'), done);
    }
  });
  fastify.addContentTypeParser('*', (req: FastifyRequest, payload: Readable, done: (err: Error | null, body?: unknown) => void) => {
    // A body announced by its length is refused without waiting for it.
    const length = req.headers['content-length'];
    if (length !== undefined && length !== '0') {
      done(new errorCodes.FST_ERR_CTP_INVALID_MEDIA_TYPE(), undefined);
      return;
    }
    let settled = false;
    const settle = (err: Error | null) => {
      if (settled) return;
      settled = true;
      payload.off('data', onData).off('end', onEnd).off('error', settle);
      done(err, undefined);
    };
    const onData = (chunk: Buffer | string) => {
      if (chunk.length > 0) settle(new errorCodes.FST_ERR_CTP_INVALID_MEDIA_TYPE());
    };
    const onEnd = () => settle(null);
    payload.on('data', onData).on('end', onEnd).on('error', settle);
    payload.resume();
  });
}
