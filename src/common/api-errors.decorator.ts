import { applyDecorators } from '@nestjs/common';
import { ApiExtraModels, ApiProperty, ApiResponse, getSchemaPath } from '@nestjs/swagger';
import type { OpenAPIObject } from '@nestjs/swagger';
import { ErrorCode, HTTP_STATUS } from './errors.js';
import { MAX_LISTED_FIELDS } from './http-errors.js';

export class ErrorDetailDto {
  @ApiProperty({ description: 'Machine-readable error code', enum: ErrorCode })
  code: ErrorCode;

  @ApiProperty({ description: 'Human-readable explanation' })
  message: string;

  @ApiProperty({
    description: 'Structured context: the fields below where they apply',
    type: 'object',
    properties: {
      fields: {
        type: 'array',
        description: 'VALIDATION_FAILED: each bad field and why',
        items: {
          type: 'object',
          required: ['field', 'reason'],
          properties: {
            field: {
              type: 'string',
              description:
                'The field: a path into the body (`items.0.value`); a path parameter, header or query-string field by its name (`pool`, `id`, `Idempotency-Key`); or `body`, `path`, `request` for the request as a whole',
            },
            reason: { type: 'string', description: 'Why it was refused' },
          },
        },
      },
      fieldsOmitted: {
        type: 'integer',
        description: `VALIDATION_FAILED with more than ${MAX_LISTED_FIELDS} bad fields: how many more there are (\`fields\` lists the first ${MAX_LISTED_FIELDS})`,
      },
      receivedAt: {
        type: 'string',
        format: 'date-time',
        description:
          "HOLD_LOST and HOLD_EXPIRED: when the instance received the request (its own clock), to compare with the hold's `expiresAt`",
      },
      outcome: {
        type: 'string',
        enum: ['unknown'],
        description:
          'DEPENDENCY_UNAVAILABLE of a confirm or a task complete: "unknown" when Postgres could not be asked whether ' +
          'the commit, sent before it stopped answering, landed; the same call again tells (absent: nothing was changed)',
      },
      roles: {
        type: 'array',
        items: { type: 'string', enum: ['admin', 'client', 'reviewer'] },
        description: 'UNAUTHENTICATED and FORBIDDEN (API_KEYS set): the roles whose keys may make the call',
      },
      role: { type: 'string', description: "FORBIDDEN for a key's role: the role of the key sent" },
      actingFor: {
        type: 'string',
        description: 'FORBIDDEN for another owner: the owner (or reviewer) the key sent is bound to',
      },
      confirmInProgress: {
        type: 'boolean',
        description:
          'RESERVATION_CLOSED of an extend, heartbeat, DELETE or abandon: true while a confirm (or complete) of the ' +
          'reservation is committing; it is confirmed when that ends, or held again if the confirm failed (absent: closed)',
      },
      searchLimited: {
        type: 'boolean',
        description:
          'POOL_EXHAUSTED of a reserve with several filter attributes: true when the search stopped at its limit of ' +
          'candidates before it had seen them all; matching free items may exist (absent: none match)',
      },
      dependency: {
        type: 'string',
        enum: ['postgres', 'redis', 'instance'],
        description:
          'DEPENDENCY_UNAVAILABLE: what is unavailable; "instance": this instance is shutting down (send the call again, ' + 'to another)',
      },
      report: {
        type: 'object',
        additionalProperties: true,
        description: 'DEPENDENCY_UNAVAILABLE of GET /health/ready: the check of each dependency',
      },
      id: {
        type: 'string',
        description: 'RESERVATION_NOT_FOUND, HOLD_EXPIRED and RESERVATION_CLOSED: the reservation or lease',
      },
      reservationId: { type: 'string', description: 'RESERVATION_CLOSED of a confirm: the reservation, released' },
      resourceId: {
        type: 'string',
        description: 'NOT_IN_RESERVATION, NOT_ALLOCATED and RESOURCE_NOT_FOUND: the resource the error is about',
      },
      resourceIds: {
        type: 'array',
        items: { type: 'string' },
        description: 'HOLD_LOST: the items taken by someone else; DEPENDENCY_UNAVAILABLE of a confirm given up: the items it chose',
      },
      reason: {
        type: 'string',
        enum: ['held_by_another', 'version_changed'],
        description:
          "HOLD_LOST: another reservation or lease holds the item, or the item's version in Postgres is no longer the one " +
          'the hold was taken at',
      },
      confirmed: {
        type: 'array',
        items: { type: 'string' },
        description: 'RESERVATION_CLOSED of a confirm: the selection the reservation was confirmed with',
      },
      owner: { type: 'string', description: 'NOT_ALLOCATED: the owner the release named' },
      pool: { type: 'string', description: 'POOL_EXHAUSTED, POOL_EXISTS, POOL_NOT_FOUND and RESOURCE_NOT_FOUND: the pool' },
      count: { type: 'integer', description: 'POOL_EXHAUSTED: the items the reserve asked for' },
      held: { type: 'integer', description: 'OWNER_QUOTA_EXCEEDED: the items the owner (or reviewer) holds now' },
      maxHoldsPerOwner: { type: 'integer', description: "OWNER_QUOTA_EXCEEDED: the pool's limit" },
      idempotencyKey: { type: 'string', description: 'IDEMPOTENCY_KEY_REUSED: the key' },
      waitingReserves: {
        type: 'integer',
        description: "RATE_LIMITED of a reserve with waitMs: the instance's limit of waiting reserves (MAX_WAITING_RESERVES)",
      },
      limitPerSecond: {
        type: 'integer',
        description: "RATE_LIMITED by the instance's request limit: the requests a second it allows (RATE_LIMIT_PER_SECOND)",
      },
      waitersAhead: {
        type: 'integer',
        description:
          'POOL_EXHAUSTED of a reserve with waitMs, after its wait: at its last try, enough items matching its filter were ' +
          'free but for those kept for this many reserves that began to wait with the same filter before it and that ' +
          'they could serve (of the 64 first in line; absent: too few were free)',
      },
    },
    additionalProperties: true,
  })
  details: Record<string, unknown>;
}

export class ErrorResponseDto {
  @ApiProperty({ description: 'The error', type: ErrorDetailDto })
  error: ErrorDetailDto;
}

/** Documents the error answers of a route, grouped by status, each with the API's error body. */
export function ApiErrors(...codes: ErrorCode[]): MethodDecorator & ClassDecorator {
  const byStatus = new Map<number, ErrorCode[]>();
  // Every route refuses a query string or a bad path with VALIDATION_FAILED, and may find a dependency down, or
  // rate limit. (A body over the limit, and answers from outside the route: see addTransportResponses.)
  const all = new Set([...codes, ErrorCode.VALIDATION_FAILED, ErrorCode.DEPENDENCY_UNAVAILABLE, ErrorCode.RATE_LIMITED]);
  for (const code of all) {
    const status = HTTP_STATUS[code];
    byStatus.set(status, [...(byStatus.get(status) ?? []), code]);
  }
  return applyDecorators(
    ApiExtraModels(ErrorResponseDto),
    ...[...byStatus].map(([status, list]) =>
      ApiResponse({ status, description: list.join(', '), schema: { $ref: getSchemaPath(ErrorResponseDto) } }),
    ),
  );
}

/**
 * Answers any route may give before or outside its handler, written into the document for each operation that does not
 * list them yet: Node's HTTP parser's 408 (a request, headers and body, that did not arrive within REQUEST_TIMEOUT_MS)
 * and 431 (headers too large), both VALIDATION_FAILED naming `request`, and 500 INTERNAL_ERROR (a fault of the service
 * itself, logged with the request id); and, on every route whose method carries a body (all but GET and HEAD, whose
 * bodies Fastify ignores), 413 PAYLOAD_TOO_LARGE for a body over BODY_LIMIT_BYTES, whether it takes a body or not.
 */
export function addTransportResponses(document: OpenAPIObject): OpenAPIObject {
  const answers: [string, string, boolean][] = [
    [String(HTTP_STATUS[ErrorCode.PAYLOAD_TOO_LARGE]), `${ErrorCode.PAYLOAD_TOO_LARGE}: the body is over BODY_LIMIT_BYTES`, true],
    ['408', `${ErrorCode.VALIDATION_FAILED} (field \`request\`): the request did not arrive whole within REQUEST_TIMEOUT_MS`, false],
    ['431', `${ErrorCode.VALIDATION_FAILED} (field \`request\`): the request headers are too large`, false],
    [String(HTTP_STATUS[ErrorCode.INTERNAL_ERROR]), `${ErrorCode.INTERNAL_ERROR}: a fault of the service itself, logged with the request id`, false],
  ];
  for (const methods of Object.values(document.paths)) {
    for (const method of ['get', 'post', 'put', 'patch', 'delete'] as const) {
      const operation = methods[method];
      if (!operation) continue;
      for (const [status, description, withBody] of answers) {
        if (operation.responses[status] || (withBody && method === 'get')) continue;
        operation.responses[status] = {
          description,
          content: { 'application/json': { schema: { $ref: getSchemaPath(ErrorResponseDto) } } },
        };
      }
    }
  }
  return document;
}
